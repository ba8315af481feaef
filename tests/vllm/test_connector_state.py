"""The scheduler part's typed per-request state (``lw_vllm.request.request_state``) and its collaborators
given in the constructor: cheap, no engine.

* ``RemotePrefill``: WAITING -> ANSWERED is the only transition, an outcome belongs to ANSWERED
  alone, and ``detail`` gives the strings the stats record (and lw-bench pd) read.
* ``SchedulerSide`` counts a lookup the pool could not answer in the collector it was built with,
  where the lookup fails (no proxy around the backend), and treats it as a miss.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_core.backend import BackendUnavailable  # noqa: E402
from lw_core.backends.memory import MemoryBackend  # noqa: E402
from lw_core.backends.registry import BackendPlugin, register_backend, unregister_backend  # noqa: E402
from lw_core.config import parse_config  # noqa: E402
from lw_vllm.metrics import Collector  # noqa: E402
from lw_vllm.request.request_state import Outcome, RemotePhase, RemotePrefill, ReqState  # noqa: E402
from lw_vllm.scheduler.scheduler_side import SchedulerSide  # noqa: E402

BLOCK = 16


def test_waiting_is_answered_once_and_then_reports_the_outcome() -> None:
    rp = RemotePrefill(RemotePhase.WAITING)
    assert rp.waiting and not rp.answered_ok and rp.wait_s is None and rp.detail == "waiting"
    rp.answer(Outcome(True, "ok", 0.25))
    assert rp.phase is RemotePhase.ANSWERED and not rp.waiting
    assert rp.answered_ok and rp.detail == "ok" and rp.wait_s == 0.25
    with pytest.raises(ValueError, match="ANSWERED.*only WAITING"):
        rp.answer(Outcome(True, "ok", 0.5))


def test_a_failed_answer_is_not_ok_and_keeps_its_detail() -> None:
    rp = RemotePrefill(RemotePhase.WAITING)
    rp.answer(Outcome(False, "no metaserver answer within 2 s", 2.0))
    assert not rp.answered_ok and rp.detail == "no metaserver answer within 2 s" and rp.wait_s == 2.0


@pytest.mark.parametrize("phase,text", [(RemotePhase.NOTHING_TO_LOAD, "nothing to load"),
                                        (RemotePhase.POOL_HOLDS_PROMPT, "pool holds the prompt")])
def test_phases_without_a_call_answer_nothing_and_keep_the_stats_strings(phase, text) -> None:
    rp = RemotePrefill(phase)
    assert rp.detail == text and rp.wait_s is None and not rp.waiting and not rp.answered_ok
    with pytest.raises(ValueError, match=phase.name):
        rp.answer(Outcome(True, "ok", 0.0))


def test_bad_params_carry_their_message() -> None:
    rp = RemotePrefill(RemotePhase.BAD_PARAMS, error="bad kv_transfer_params: x")
    assert rp.detail == "bad kv_transfer_params: x" and not rp.answered_ok


@pytest.mark.parametrize("kw", [dict(phase=RemotePhase.WAITING, outcome=Outcome(True, "ok", 0.0)),
                                dict(phase=RemotePhase.ANSWERED),
                                dict(phase=RemotePhase.BAD_PARAMS),
                                dict(phase=RemotePhase.NOTHING_TO_LOAD, error="x")])
def test_inconsistent_states_are_refused(kw) -> None:
    with pytest.raises(ValueError, match="alone"):
        RemotePrefill(**kw)


def test_req_state_of_a_request() -> None:
    req = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3], arrival_time=12.5)
    st = ReqState.of(req, "par")
    assert st.prompt_len == 3 and st.parent == "par" and st.t == {"arrival": 12.5}
    assert st.remote is None and st.saved_upto == 0 and st.hashes == [] and st.load is None
    other = ReqState.of(req, None)
    assert other.hashes is not st.hashes and other.t is not st.t  # nothing shared between requests


class _LookupFails(MemoryBackend):
    name = "lookup-fails"

    def lookup(self, keys):  # noqa: ANN001
        raise BackendUnavailable("store down")


@pytest.fixture
def failing_backend() -> Iterator[str]:
    register_backend("lookup-fails", lambda: BackendPlugin(name="lookup-fails",
                                                           open=lambda cfg, **kw: _LookupFails(1 << 20)))
    yield "lookup-fails"
    unregister_backend("lookup-fails")


def _side(backend: str, metrics: Collector) -> SchedulerSide:
    spec = SimpleNamespace(block_size=BLOCK, page_size_bytes=1024)
    kc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-test", dtype="float32", use_mla=False, hf_config=SimpleNamespace()),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )
    cfg = parse_config({"backend": backend, "lookup_timeout_s": 2.0})
    return SchedulerSide(vc, kc, cfg, "kv_both", metrics)


def test_lookup_error_is_counted_where_it_happens_and_is_a_miss(failing_backend) -> None:
    metrics = Collector()
    side = _side(failing_backend, metrics)
    try:
        toks = list(range(3, 3 + 3 * BLOCK + 1))
        req = SimpleNamespace(request_id="r1", all_token_ids=toks, prompt_token_ids=toks, kv_transfer_params=None,
                              lora_request=None, cache_salt=None, mm_features=None)
        assert side.metrics is metrics
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert side.last_call_looked_up
        data = metrics.take().data
        assert data["lookup_errors"] == 1
        assert isinstance(side.backend, _LookupFails)  # the backend itself, not a wrapper
    finally:
        side.shutdown()
