"""The decoder's metaserver client (lw_vllm.pd.pd_metaserver) against an aiohttp metaserver on
127.0.0.1: one POST per request id with the wire body, outcomes for 200 / error / silence /
unreachable, deadlines that hold without blocking the caller, and cancellation on forget."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from lw_bench.pd.stack import free_port
from lw_core.wire import DecodeTransferParams
from lw_dev.fake_metaserver import FakeMetaserver
from lw_vllm.pd.pd_metaserver import MetaserverClient, remote_prefill_params


@pytest.fixture(scope="module")
def server() -> Iterator[FakeMetaserver]:
    s = FakeMetaserver()
    yield s
    s.close()


@pytest.fixture
def client() -> Iterator[MetaserverClient]:
    c = MetaserverClient(timeout_s=1.0)
    yield c
    c.close()


def _params(url: str, parent: str = "parent-1") -> DecodeTransferParams:
    return DecodeTransferParams(metaserver=url, lw_parent_id=parent, lw_children=1)


def _wait(client: MetaserverClient, rid: str, limit_s: float = 10.0):
    deadline = time.monotonic() + limit_s
    slowest = 0.0
    while True:
        t = time.perf_counter()
        out = client.poll(rid)
        slowest = max(slowest, time.perf_counter() - t)
        if out is not None:
            return out, slowest
        assert time.monotonic() < deadline, "no outcome within the test's limit"
        time.sleep(0.005)


def test_ok_posts_the_wire_body_once(server: FakeMetaserver, client: MetaserverClient) -> None:
    server.mode, server.bodies = "ok", []
    client.post("req-A", _params(server.url, "parent-A"))
    client.post("req-A", _params(server.url, "parent-A"))  # vLLM asks again: no second POST
    out, _ = _wait(client, "req-A")
    assert out.ok and out.detail == "ok" and out.wait_s >= 0
    # needs_prefill: None from a caller that does not say (what an older decoder's body means)
    assert server.bodies == [{"lw_parent_id": "parent-A", "request_id": "req-A", "needs_prefill": None,
                            "forces_first": None}]
    assert client.poll("req-A") is out  # the outcome sticks


def test_error_status_means_recompute_with_the_reason(server: FakeMetaserver, client: MetaserverClient) -> None:
    server.mode = "error"
    client.post("req-E", _params(server.url))
    out, _ = _wait(client, "req-E")
    assert not out.ok and "502" in out.detail and "prefill failed" in out.detail


def test_unexpected_200_body_is_not_ok(server: FakeMetaserver, client: MetaserverClient) -> None:
    server.mode = "bad-body"
    client.post("req-B", _params(server.url))
    out, _ = _wait(client, "req-B")
    assert not out.ok and "unexpected body" in out.detail


def test_silent_metaserver_times_out_and_poll_never_blocks(server: FakeMetaserver, client: MetaserverClient) -> None:
    server.mode = "silent"
    t0 = time.monotonic()
    client.post("req-S", _params(server.url))
    out, slowest_poll = _wait(client, "req-S")
    waited = time.monotonic() - t0
    assert not out.ok and "no metaserver answer within 1 s" in out.detail
    assert 0.9 <= waited < 5.0, waited
    assert slowest_poll < 0.05, f"poll took {slowest_poll:.3f} s: it must never wait"


def test_unreachable_metaserver_fails_fast(client: MetaserverClient) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/metaserver"  # nothing listens there
    client.post("req-U", _params(url))
    out, _ = _wait(client, "req-U", limit_s=5)
    assert not out.ok and "unreachable" in out.detail and out.wait_s < 1.0


def test_forget_cancels_the_held_post(server: FakeMetaserver) -> None:
    server.mode, server.cancelled = "silent", 0
    c = MetaserverClient(timeout_s=30.0)
    try:
        c.post("req-F", _params(server.url))
        deadline = time.monotonic() + 5
        while not any(b["request_id"] == "req-F" for b in server.bodies):
            assert time.monotonic() < deadline, "POST never arrived"
            time.sleep(0.01)
        c.forget("req-F")
        assert c.poll("req-F") is None  # forgotten: no state left
        while "req-F" not in server.cancelled_ids:
            assert time.monotonic() < deadline, "the metaserver never saw the POST go away"
            time.sleep(0.01)
    finally:
        t = time.monotonic()
        c.close()
        assert time.monotonic() - t < 6


@pytest.mark.parametrize("raw", [
    None,
    {},
    {"do_remote_decode": True, "lw_parent_id": "p"},  # the prefill side's params
    {"do_remote_prefill": False, "metaserver": "http://x/v1/metaserver", "lw_parent_id": "p"},
    # Another connector's PD params (NIXL): not ours, left alone.
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h"},
])
def test_requests_that_are_not_layerwise_remote_prefills(raw) -> None:
    assert remote_prefill_params(raw) is None


def test_remote_prefill_params_parsed() -> None:
    p = remote_prefill_params({"do_remote_prefill": True, "do_remote_decode": False, "lw_parent_id": "p1",
                               "metaserver": "http://127.0.0.1:1/v1/metaserver", "lw_children": 3})
    assert isinstance(p, DecodeTransferParams) and p.lw_parent_id == "p1" and p.lw_children == 3


@pytest.mark.parametrize("raw,needle", [
    ({"do_remote_prefill": True, "metaserver": "http://h:1/v1/metaserver"}, "lw_parent_id"),
    ({"do_remote_prefill": True, "metaserver": "http://h:1/v1/metaserver", "lw_parent_id": 7}, "lw_parent_id"),
    ({"do_remote_prefill": True, "metaserver": "http://h:1/v1/metaserver", "lw_parent_id": "p", "lw_children": 0},
     "lw_children"),
    ({"do_remote_prefill": True, "metaserver": "h:1/v1/metaserver", "lw_parent_id": "p"}, "http://"),
])
def test_malformed_params_are_reported_naming_the_field(raw, needle: str) -> None:
    err = remote_prefill_params(raw)
    assert isinstance(err, str) and needle in err, err


def test_wait_for_answer_wakes_on_the_answer_and_is_bounded(server: FakeMetaserver, client: MetaserverClient) -> None:
    server.mode = "silent"
    client.post("req-W1", _params(server.url))
    t = time.perf_counter()
    assert client.wait_for_answer(0.1) is False
    assert 0.09 <= time.perf_counter() - t < 0.5
    server.mode = "ok"
    client.post("req-W2", _params(server.url))
    t = time.perf_counter()
    assert client.wait_for_answer(5.0) is True
    assert time.perf_counter() - t < 2.0
    assert client.poll("req-W2").ok


def test_forget_without_cancel_lets_the_call_finish(server: FakeMetaserver, client: MetaserverClient) -> None:
    server.mode, server.bodies, server.cancelled = "silent", [], 0
    client.post("req-K", _params(server.url))
    client.forget("req-K", cancel=False)
    assert client.poll("req-K") is None
    deadline = time.monotonic() + 5
    while not server.bodies:
        assert time.monotonic() < deadline, "the POST never arrived"
        time.sleep(0.01)
    time.sleep(0.2)
    assert "req-K" not in server.cancelled_ids
