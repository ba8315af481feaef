"""PdCoordinator on its own: no pool, no engine, no HTTP. A lookup function and a metaserver
stand-in drive the state the coordinator alone owns: the streaming receives parked and in flight,
the idle wait (once per scheduling pass, only after an empty step), and the metaserver client
(closed with the coordinator), and its allow list: a metaserver URL it does not allow is never
posted. The same paths through SchedulerSide over a real pool are ``test_scheduler_pd.py``."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_core.config import parse_config  # noqa: E402
from lw_core.keys import KeySpace  # noqa: E402
from lw_core.metaserver_allow import MetaserverAllowList  # noqa: E402
from lw_vllm.meta import LayerwiseMeta  # noqa: E402
from lw_vllm.metrics import Collector  # noqa: E402
from lw_vllm.pd import pd_coordinator  # noqa: E402
from lw_vllm.pd.pd_coordinator import POOL_POLL_S, PdCoordinator  # noqa: E402
from lw_vllm.request.request_state import Outcome, RemotePhase, ReqState  # noqa: E402

BLOCK = 16
MS_URL = "http://ms:1/v1/metaserver"


class Metaserver:
    """What the coordinator calls on ``MetaserverClient``, answering from ``answers``; ``allow``:
    the URLs it may call (the test requests' own by default)."""

    def __init__(self, allow: MetaserverAllowList | None = None) -> None:
        self.allow = allow if allow is not None else MetaserverAllowList([MS_URL])
        self.posted: list[tuple[str, bool | None]] = []
        self.answers: dict[str, Outcome] = {}
        self.forgotten: list[tuple[str, bool]] = []
        self.waits = 0
        self.closed = False

    def post(self, request_id, params, needs_prefill=None, forces_first=None) -> None:
        self.posted.append((request_id, needs_prefill))

    def poll(self, request_id):
        return self.answers.get(request_id)

    def wait_for_answer(self, timeout_s: float) -> bool:
        self.waits += 1
        time.sleep(timeout_s)
        return False

    def forget(self, request_id, *, cancel=True) -> None:
        self.forgotten.append((request_id, cancel))

    def close(self) -> None:
        self.closed = True


class Pool:
    """The lookup function: the leading hashes found in ``held``."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()

    def __call__(self, hashes, keyspace=None, tags=None) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n


def _coordinator(pool: Pool, ms: Metaserver | None, metrics: Collector | None = None, **extra) -> PdCoordinator:
    cfg = parse_config({"use_layerwise": True, **extra})
    return PdCoordinator(cfg, BLOCK, KeySpace(model_fp="m", layout_fp="l"), ["t0"], {}, ms,  # type: ignore[arg-type]
                         metrics or Collector(), pool, lambda tp: f"saved at {tp}")


def _state(rid: str, n_tokens: int, parent: str = "par", url: str = MS_URL) -> ReqState:
    toks = list(range(3, 3 + n_tokens))
    params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": url,
              "lw_parent_id": parent, "lw_children": 1}
    req = SimpleNamespace(request_id=rid, all_token_ids=toks, prompt_token_ids=toks, kv_transfer_params=params,
                          lora_request=None, cache_salt=None, mm_features=None, skip_reading_prefix_cache=False)
    return ReqState.of(req, parent)


def _plan(c: PdCoordinator, build: int, empty: bool = False) -> LayerwiseMeta:
    c.begin_step(build, empty)
    meta = LayerwiseMeta()
    c.plan_streams(meta)
    return meta


def test_a_streaming_receive_is_sent_once_and_its_answer_relayed_once() -> None:
    ms = Metaserver()
    c = _coordinator(Pool(), ms, pd_streaming=True)
    st = _state("r-s", 3 * BLOCK + 5)
    assert c.remote_prefill(st, 0) is True and st.remote is not None and st.remote.phase is RemotePhase.STREAMING
    assert ms.posted == [("r-s", True)]
    assert c.stream_match(st, 0) == (3 * BLOCK + 4, True)  # the whole prompt but its last token
    st.load = (0, 4)  # what SchedulerSide.update_state_after_alloc sets
    c.park(st, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)))
    (x,) = _plan(c, 1, empty=True).stream_loads
    assert x.block_ids == [5, 6, 7, 8] and x.hashes == c.prompt_hashes(st) and len(x.hashes) == 4
    assert st.last_xfer_build == 1 and st.stream_sent
    assert c.stream_match(st, 0) == (0, False)  # asked again after the receive: vLLM holds what arrived
    meta = _plan(c, 2)
    assert meta.stream_loads == [] and meta.stream_prefilled == [] and meta.stream_cancels == []
    ms.answers["r-s"] = Outcome(True, "ok", 0.1)
    assert _plan(c, 3).stream_prefilled == ["r-s"]
    assert _plan(c, 4).stream_prefilled == []  # relayed once
    c.close()
    assert ms.closed


def test_a_finished_request_leaves_no_stream_to_answer() -> None:
    ms = Metaserver()
    c = _coordinator(Pool(), ms, pd_streaming=True)
    st = _state("r-f", 2 * BLOCK + 1)
    assert c.remote_prefill(st, 0) is True
    assert c.stream_match(st, 0) == (2 * BLOCK, True)
    st.load = (0, 3)
    c.park(st, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)))
    assert len(_plan(c, 1).stream_loads) == 1
    c.request_finished("r-f", st)
    assert ms.forgotten == [("r-f", False)]  # not waiting: the call runs on for the parent's siblings
    ms.answers["r-f"] = Outcome(False, "metaserver answered 502", 0.1)
    assert _plan(c, 2).stream_cancels == []


def test_the_idle_wait_comes_once_per_pass_and_only_after_an_empty_step() -> None:
    ms, pool = Metaserver(), Pool()
    c = _coordinator(pool, ms)
    st = _state("r-w", 3 * BLOCK)
    c.begin_step(1, empty=False)
    assert c.remote_prefill(st, 0) is None and st.remote is not None and st.remote.waiting
    assert ms.waits == 0  # another request ran last step: no wait
    c.begin_step(2, empty=True)
    assert c.remote_prefill(st, 0) is None and ms.waits > 0
    waits = ms.waits
    assert c.remote_prefill(st, 0) is None and ms.waits == waits  # the same pass: no second wait
    pool.held.update(c.prompt_hashes(st))  # the prefiller committed the whole prompt
    time.sleep(2 * POOL_POLL_S)
    assert c.remote_prefill(st, 0) is True  # seen in the pool: no answer needed
    assert st.remote.answered_ok and st.pool_seen
    c.request_finished("r-w", st)
    assert ms.forgotten == [("r-w", False)]


def test_a_prefiller_has_no_metaserver_and_no_remote_prefill() -> None:
    c = _coordinator(Pool(), None)
    st = _state("r-p", 3 * BLOCK)
    assert c.remote_prefill(st, 0) is False and st.remote is None
    c.request_finished("r-p", st)
    c.close()


def test_a_metaserver_not_allowed_is_never_posted_and_logged_once_a_minute(caplog, monkeypatch) -> None:
    ms = Metaserver(MetaserverAllowList(None))  # the default: a proxy on loopback only
    metrics = Collector()
    c = _coordinator(Pool(), ms, metrics)
    urls = ["http://ms:1/v1/metaserver", "http://127.0.0.1:1/admin", "http://169.254.169.254/v1/metaserver"]
    with caplog.at_level(logging.WARNING, logger=pd_coordinator.__name__):
        for i, url in enumerate(urls):
            st = _state(f"r-{i}", 3 * BLOCK, url=url)
            assert c.remote_prefill(st, 0) is True  # computed here, from what the pool holds: never waits
            assert st.remote is not None and st.remote.phase is RemotePhase.BAD_PARAMS
            assert "is not allowed" in st.remote.detail and "pd_allowed_metaservers" in st.remote.detail
            assert c.remote_prefill(st, 0) is True  # vLLM asks again: decided once, counted once
    assert ms.posted == []
    lines = [r.getMessage() for r in caplog.records if "remote prefill refused" in r.getMessage()]
    assert len(lines) == 1 and "http://ms:1/v1/metaserver" in lines[0], lines
    stats = metrics.take()
    assert stats is not None and stats.data["pd_metaserver_refused"] == len(urls)
    monkeypatch.setattr(pd_coordinator, "REFUSED_LOG_S", 0.0)  # a minute later: the next one is logged, with a count
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=pd_coordinator.__name__):
        c.remote_prefill(_state("r-late", 3 * BLOCK, url=urls[1]), 0)
    (line,) = [r.getMessage() for r in caplog.records if "remote prefill refused" in r.getMessage()]
    assert "2 more refused since the last message" in line
    st = _state("r-ok", 3 * BLOCK, url="http://127.0.0.1:8000/v1/metaserver")  # allowed: posted
    assert c.remote_prefill(st, 0) is None and ms.posted == [("r-ok", True)]
