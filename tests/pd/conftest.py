"""Module-scoped 1P1D stacks (prefiller + decoder vLLM OpenAI servers, lw-proxy) on 127.0.0.1.

Each test module that asks for a stack gets its own, started once and always stopped; the pool
is a fresh embedded pool on tmpfs. A stack whose next module asks for the same fixture is handed
on to it instead (engine starts are most of these modules' time); the last module stops it. Servers' logs stay under pytest's tmp dir for post-mortems.
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


def _stack(model: str, timeout_s: float, tmp_path_factory: pytest.TempPathFactory, tools: bool = False,
           reasoning_parser: str | None = None) -> Iterator[Stack]:
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")
    log_dir = tmp_path_factory.mktemp(f"pd-{model}")
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else log_dir
    pool = base / f"lw-pd-pool-{uuid.uuid4().hex[:8]}"
    stack = start_stack(model, log_dir, str(pool), metaserver_timeout_s=timeout_s, tools=tools,
                        reasoning_parser=reasoning_parser)
    try:
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(pool, ignore_errors=True)


_KEPT: dict[str, tuple[Iterator[Stack], Stack]] = {}  # fixture name -> (its generator, its stack)
_NEXT: list[pytest.Item | None] = [None]  # the item after the one being torn down


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _NEXT[0] = nextitem  # read by the stacks' teardown, which runs after this hook


def pytest_sessionfinish() -> None:
    while _KEPT:  # an interrupted session: nothing is handed on any more
        next(_KEPT.popitem()[1][0], None)


def _module_stack(model: str, timeout_s: float, *, streaming: bool = False, name: str | None = None,
                  tools: bool = False, reasoning_parser: str | None = None) -> Any:
    """A module-scoped fixture of ``model``'s stack (``pd_streaming`` on when ``streaming``; tool
    calling on when ``tools``, a reasoning parser, ``lw_bench.pd.stack.start_vllm``). With
    ``name``, the fixture of that name hands its stack on to the next module when that module asks
    for the same fixture, instead of stopping it."""

    @pytest.fixture(scope="module", name=name)
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        gen, s = _KEPT.pop(name, (None, None)) if name else (None, None)
        if gen is None or s is None:
            gen = (streaming_stack(model, timeout_s, tmp_path_factory) if streaming
                   else _stack(model, timeout_s, tmp_path_factory, tools, reasoning_parser))
            s = next(gen)
        yield s
        nxt = _NEXT[0]
        if name and nxt is not None and name in getattr(nxt, "fixturenames", ()):
            _KEPT[name] = (gen, s)
        else:
            next(gen, None)  # runs the stack's finally: stopped, its pool removed

    return stack


gqa_stack = _module_stack("gqa", GQA_METASERVER_TIMEOUT_S)
mla_stack = _module_stack("mla", MLA_METASERVER_TIMEOUT_S)
swa_stack = _module_stack("swa", GQA_METASERVER_TIMEOUT_S, tools=True)  # test_pd_swa calls tools too
gdn_stack = _module_stack("gdn", GQA_METASERVER_TIMEOUT_S)
# Engines that run a reasoning parser (test_pd_reasoning): the proxy learns it from their answers.
reasoning_stack = _module_stack("gqa", GQA_METASERVER_TIMEOUT_S, reasoning_parser="granite")
mamba2_stack = _module_stack("mamba2", GQA_METASERVER_TIMEOUT_S)
# The hybrids' streaming stacks; their modules time the receive against STREAM_TIMEOUT_S.
swa_stream_stack = _module_stack("swa", STREAM_TIMEOUT_S, streaming=True)
gdn_stream_stack = _module_stack("gdn", STREAM_TIMEOUT_S, streaming=True)
mamba2_stream_stack = _module_stack("mamba2", STREAM_TIMEOUT_S, streaming=True)
# test_pd_streaming and test_pd_streaming_faults (last: it kills the prefiller) share one: both time
# the receive against GQA_STREAM_TIMEOUT_S.
GQA_STREAM_TIMEOUT_S = 10.0
gqa_stream_stack = _module_stack("gqa", GQA_STREAM_TIMEOUT_S, streaming=True, name="gqa_stream_stack")


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
