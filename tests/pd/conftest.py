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

import pytest

from lw_bench.pd.stack import Stack, start_stack
from lw_dev.fake_metaserver import FakeMetaserver

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


@pytest.fixture(scope="module")
def gqa_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _stack("gqa", GQA_METASERVER_TIMEOUT_S, tmp_path_factory)


@pytest.fixture(scope="module")
def mla_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _stack("mla", MLA_METASERVER_TIMEOUT_S, tmp_path_factory)


@pytest.fixture(scope="module")
def swa_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _stack("swa", GQA_METASERVER_TIMEOUT_S, tmp_path_factory)


@pytest.fixture(scope="module")
def gdn_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _stack("gdn", GQA_METASERVER_TIMEOUT_S, tmp_path_factory)


@pytest.fixture(scope="module")
def mamba2_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _stack("mamba2", GQA_METASERVER_TIMEOUT_S, tmp_path_factory)


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
