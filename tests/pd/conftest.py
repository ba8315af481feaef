"""Module-scoped 1P1D stacks (prefiller + decoder vLLM OpenAI servers, lw-proxy) on 127.0.0.1.

Each test module that asks for a stack gets its own, started once and always stopped; the pool
is a fresh embedded pool on tmpfs. Servers' logs stay under pytest's tmp dir for post-mortems.
The engine-free scheduler tests (test_scheduler_pd.py and the modules that reuse its helpers) take
a metaserver stand-in (``meta``, one per module) and a fresh pool directory (``pool_dir``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lw_bench.pd.stack import Stack, start_stack
from lw_dev.fake_metaserver import FakeMetaserver
from lw_dev.pd_streaming_flow import STREAM_TIMEOUT_S, streaming_stack

# Decoders give up on the metaserver after this; the never-called-back test waits it out. Generous:
# a tiny prefill takes ~0.1 s once warmed up, but a shared 2-core host can stall it for seconds.
GQA_METASERVER_TIMEOUT_S = 12.0
MLA_METASERVER_TIMEOUT_S = 30.0


def _stack(model: str, timeout_s: float, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")
    log_dir = tmp_path_factory.mktemp(f"pd-{model}")
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else log_dir
    pool = base / f"lw-pd-pool-{uuid.uuid4().hex[:8]}"
    stack = start_stack(model, log_dir, str(pool), metaserver_timeout_s=timeout_s)
    try:
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(pool, ignore_errors=True)


def _module_stack(model: str, timeout_s: float, *, streaming: bool = False) -> Any:
    """A module-scoped fixture of ``model``'s stack (``pd_streaming`` on when ``streaming``)."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        yield from (streaming_stack if streaming else _stack)(model, timeout_s, tmp_path_factory)

    return stack


gqa_stack = _module_stack("gqa", GQA_METASERVER_TIMEOUT_S)
mla_stack = _module_stack("mla", MLA_METASERVER_TIMEOUT_S)
swa_stack = _module_stack("swa", GQA_METASERVER_TIMEOUT_S)
gdn_stack = _module_stack("gdn", GQA_METASERVER_TIMEOUT_S)
mamba2_stack = _module_stack("mamba2", GQA_METASERVER_TIMEOUT_S)
# The hybrids' streaming stacks; their modules time the receive against STREAM_TIMEOUT_S.
swa_stream_stack = _module_stack("swa", STREAM_TIMEOUT_S, streaming=True)
gdn_stream_stack = _module_stack("gdn", STREAM_TIMEOUT_S, streaming=True)
mamba2_stream_stack = _module_stack("mamba2", STREAM_TIMEOUT_S, streaming=True)


@pytest.fixture(scope="module")
def meta() -> Iterator[FakeMetaserver]:
    s = FakeMetaserver()
    yield s
    s.close()


@pytest.fixture
def pool_dir() -> Iterator[str]:
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path("/tmp")
    p = base / f"lw-pd-sched-{uuid.uuid4().hex[:8]}"
    yield str(p)
    shutil.rmtree(p, ignore_errors=True)
