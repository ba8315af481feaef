"""When a parent's prefill is dispatched (``--prefill-dispatch``): ``early`` sends it with
the client request, in parallel with the decoder, so the decoder's scheduling and metaserver POST are
off the critical path; ``on-metaserver`` waits for every child's POST. And what happens to a prefill
still running when its parent closes: left to finish once a decoder answered, cancelled otherwise."""

from __future__ import annotations

import asyncio
import time

import pytest

from lw_dev.proxy_mocks import METASERVER_OK, harness, run, wait_until
from lw_proxy.config import parse_args

OK = METASERVER_OK  # a 200 answer (it may carry the prefill's first token)


def _metric(outcome: str) -> str:
    return f'lw_proxy_prefill_dispatches_total{{outcome="{outcome}"}}'


def test_early_prefill_starts_before_any_metaserver_post():
    async def body():
        async with harness(continue_after_prefill=False) as h:
            h.decoders[0].knobs.delay = 0.5  # the decoder is slow to schedule and POST its callback
            req = asyncio.ensure_future(h.post("/v1/completions", {"prompt": "p", "max_tokens": 2}))
            await wait_until(lambda: h.prefillers[0].bodies, timeout=0.4, what="the prefill, before the POST")
            assert h.decoders[0].metaserver_results == []
            status, _ = await req
            assert status == 200 and h.decoders[0].metaserver_results == [OK]
            assert len(h.prefillers[0].bodies) == 1
            parent_id = h.decoders[0].bodies[0]["kv_transfer_params"]["lw_parent_id"]
            assert h.prefillers[0].bodies[0]["kv_transfer_params"]["lw_parent_id"] == parent_id

    run(body())


class _PostOrder:
    """The proxy's client session, recording which backend each POST went to, in order."""

    def __init__(self, session, prefill_url: str) -> None:
        self._s, self._pf, self.order = session, prefill_url, []

    def post(self, url: str, *a, **kw):
        self.order.append("prefill" if url.startswith(self._pf) else "decode")
        return self._s.post(url, *a, **kw)

    def __getattr__(self, name: str):
        return getattr(self._s, name)


@pytest.mark.parametrize("stream", [False, True])
def test_early_prefill_is_sent_before_the_decoder_call(stream: bool):
    """The prefill is the critical path (its first token may be relayed; the decoder waits for its
    KV): early dispatch sends it before the decoder's request, not after."""
    async def body():
        async with harness() as h:
            rec = h.proxy.session = _PostOrder(h.proxy.session, h.backend_urls[0])
            b = {"prompt": "p", "max_tokens": 2, "temperature": 0, "stream": stream}
            async with h.session.post(h.url + "/v1/completions", json=b) as r:
                assert r.status == 200
                await r.read()
            assert rec.order == ["prefill", "decode"], rec.order

    run(body())


def test_on_metaserver_dispatches_only_after_the_posts():
    async def body():
        async with harness(prefill_dispatch="on-metaserver") as h:
            h.decoders[0].knobs.delay = 0.3
            req = asyncio.ensure_future(h.post("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}))
            await wait_until(lambda: h.decoders[0].bodies, what="the decoder call")
            await asyncio.sleep(0.2)
            assert h.prefillers[0].bodies == [], "no prefill before the decoder's callbacks"
            status, _ = await req
            assert status == 200 and h.decoders[0].metaserver_results == [OK, OK]
            assert len(h.prefillers[0].bodies) == 1

    run(body())


def test_early_needs_prefill_false_is_answered_at_once_and_the_prefill_runs_on():
    async def body():
        async with harness(continue_after_prefill=False) as h:  # the decoder's path (a list is continued by default)
            h.decoders[0].knobs.needs_prefill = False
            h.prefillers[0].knobs.delay = 0.5
            t0 = time.monotonic()
            status, _ = await h.post("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
            assert status == 200 and h.decoders[0].metaserver_results == [OK, OK]
            assert time.monotonic() - t0 < 0.4, "a child holding the prompt does not wait for the prefill"
            assert len(h.prefillers[0].bodies) == 1  # dispatched with the request, left to finish
            await wait_until(lambda: h.prefillers[0].completed + h.prefillers[0].aborted, what="the prefill's end")
            assert h.prefillers[0].aborted == 0
            m = await h.metrics()
            assert _metric("ok") + " 1.0" in m and _metric("cancelled") not in m
            assert _metric("skipped") not in m

    run(body())


def test_prefill_is_left_to_finish_once_the_decoder_answered():
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.skip_metaserver = True  # answers from its own cache, before the prefill ends
            h.prefillers[0].knobs.delay = 0.4
            body = {"prompt": "p", "max_tokens": 2, "stream": True}
            async with h.session.post(h.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            assert len(h.proxy.registry) == 0
            await wait_until(lambda: h.prefillers[0].completed + h.prefillers[0].aborted, what="the prefill's end")
            assert h.prefillers[0].aborted == 0, "a prefill whose decoder answered is not cancelled"
            m = await h.metrics()
            assert _metric("ok") + " 1.0" in m and _metric("cancelled") not in m

    run(body())


def test_prefill_is_cancelled_when_no_decoder_answers():
    async def body():
        async with harness(continue_after_prefill=False, max_retries=0) as h:
            h.decoders[0].knobs.status = 503
            h.prefillers[0].knobs.delay = 2.0
            status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 502
            await wait_until(lambda: h.prefillers[0].aborted == 1, what="the prefill cancelled")
            assert _metric("cancelled") + " 1.0" in await h.metrics()

    run(body())


def test_shutdown_cancels_a_prefill_left_running():
    async def body():
        t0 = None
        async with harness(continue_after_prefill=False) as h:
            h.decoders[0].knobs.skip_metaserver = True
            h.prefillers[0].knobs.delay = 10.0
            status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200
            await wait_until(lambda: h.prefillers[0].bodies, what="the prefill")
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 1.5
        assert h.prefillers[0].aborted == 1 and h.prefillers[0].completed == 0

    run(body())


@pytest.mark.parametrize("mode", ["early", "on-metaserver"])
def test_prefill_dispatch_flag(mode):
    cfg, _ = parse_args(["--prefill-dispatch", mode])
    assert cfg.prefill_dispatch == mode
    assert parse_args([])[0].prefill_dispatch == "early"


def test_prefill_dispatch_flag_names_the_accepted_values(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--prefill-dispatch", "eager"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--prefill-dispatch" in err and "'early'" in err and "'on-metaserver'" in err
