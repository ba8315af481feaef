"""A parent's prefill is dispatched at most once: a decoder that calls the
metaserver back and then fails is retried on another decoder, whose calls are answered from the
prefill already finished or running; a prefiller answering 503 is not asked again for that parent."""

from __future__ import annotations

import asyncio

import pytest

from lw_dev.proxy_mocks import METASERVER_OK, generate, harness, run, wait_until
from lw_proxy.fanin import OK_BODY
from lw_proxy.validate import parse_completion

OK = METASERVER_OK  # a 200 answer (it may carry the prefill's first token)


@pytest.mark.parametrize("mode", ["early", "on-metaserver"])
def test_retried_decoder_reuses_the_finished_prefill(mode):
    async def body():
        async with harness(continue_after_prefill=False, prefill_dispatch=mode, n_decode=2, max_retries=3) as h:
            h.decoders[0].knobs.status_after_metaserver = 503
            h.decoders[1].knobs.status_after_metaserver = 503
            h.decoders[0].knobs.health_status = h.decoders[1].knobs.health_status = 503
            status, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 502, out  # every decoder failed: 4 attempts
            assert len(h.prefillers[0].bodies) == 1, "one client request, one prefill, however many decoders"
            calls = h.decoders[0].metaserver_results + h.decoders[1].metaserver_results
            assert calls == [OK] * 4  # each attempt's callback answered from the one prefill
            m = await h.metrics()
            assert 'lw_proxy_prefill_dispatches_total{outcome="ok"} 1.0' in m
            assert "lw_proxy_prefill_reused_total 3.0" in m
            assert 'lw_proxy_retries_total{role="decoder"} 3.0' in m

    run(body())


@pytest.mark.parametrize("mode", ["early", "on-metaserver"])
def test_retried_decoder_waits_for_the_running_prefill(mode):
    async def body():
        async with harness(continue_after_prefill=False, prefill_dispatch=mode, n_decode=2) as h:
            for d in h.decoders:  # whichever is picked first fails while the prefill still runs
                d.knobs.status_after_metaserver = 503
                d.knobs.fail_times = 1
                d.knobs.wait_metaserver = False
            h.prefillers[0].knobs.delay = 0.3
            status, out = await h.post("/v1/completions", {"prompt": "q", "max_tokens": 3})
            assert status == 200, out
            assert out["choices"][0]["text"] == "".join(generate("q", 3))
            assert len(h.prefillers[0].bodies) == 1
            # 3 attempts (each decoder failed once, while the prefill ran), one prefill answering all
            assert sum(d.failed for d in h.decoders) == 2
            assert h.decoders[0].metaserver_results + h.decoders[1].metaserver_results == [OK] * 3
            assert 'lw_proxy_prefill_dispatches_total{outcome="cancelled"}' not in await h.metrics()

    run(body())


def test_unfinished_fan_in_of_an_abandoned_attempt_is_reset():
    async def body():
        async with harness(n_decode=2) as h:
            parent = h.proxy.registry.open(2, parse_completion(b'{"prompt": ["a", "b"]}'))
            # one of two ids arrived from the first decoder, which then failed: the retry forgets it,
            # so the next decoder's two ids complete the fan-in (not 409 "one too many")
            held = asyncio.ensure_future(h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": "old-1"}))
            await wait_until(lambda: len(parent.ids) == 1, what="the first id")
            h.proxy.registry.retry(parent)
            assert parent.ids == set() and parent.task is None and parent.attempts == 2
            assert (await held)[0] == 410
            new = [h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": f"new-{i}"}) for i in (1, 2)]
            assert [s for s, _ in await asyncio.gather(*new)] == [200, 200]
            assert len(h.prefillers[0].bodies) == 1
            h.proxy.registry.close(parent)

    run(body())


@pytest.mark.parametrize("mode", ["early", "on-metaserver"])
def test_request_ids_are_capped_at_lw_children_per_attempt_after_dispatch_too(mode):
    async def body():
        async with harness(prefill_dispatch=mode) as h:
            parent = h.proxy.registry.open(1, parse_completion(b'{"prompt": "a"}'))
            if mode == "early":
                h.proxy.registry.dispatch(parent)

            async def post(rid):
                return await h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": rid})

            assert (await post("r-0"))[0] == 200  # on-metaserver: this one completes the fan-in
            got = await asyncio.gather(*(post(f"r-{i}") for i in range(1, 200)))
            assert {s for s, _ in got} == {409} and "one too many" in got[0][1]["error"]["message"]
            assert parent.ids == {"r-0"}
            assert (await post("r-0"))[0] == 200  # the same id again is no new one
            h.proxy.registry.retry(parent)  # a retried decoder brings its own ids: one more attempt's worth
            assert [(await post(r))[0] for r in ("new-0", "new-1")] == [200, 409]
            assert len(parent.ids) == 2 and len(h.prefillers[0].bodies) == 1
            h.proxy.registry.close(parent)

    run(body())


def test_prefiller_answering_503_is_asked_once_per_parent():
    async def body():
        async with harness(n_prefill=2, n_decode=2, max_retries=3) as h:
            for p in h.prefillers:
                p.knobs.status = 503
            h.decoders[0].knobs.status_after_metaserver = 503
            status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200  # the second decoder recomputes
            assert [len(p.bodies) for p in h.prefillers] == [1, 1], "each prefiller tried once, then given up"
            ms, err = h.decoders[1].metaserver_results[0]
            assert ms == 502 and "2 attempt(s)" in err["error"]["message"]
            m = await h.metrics()
            assert 'lw_proxy_retries_total{role="prefiller"} 1.0' in m
            assert 'lw_proxy_prefill_dispatches_total{outcome="error"} 1.0' in m

    run(body())


def test_no_prefill_when_every_child_holds_the_prompt():
    async def body():  # on-metaserver only; early: tests/proxy/test_prefill_dispatch.py
        async with harness(prefill_dispatch="on-metaserver") as h:
            h.decoders[0].knobs.needs_prefill = False
            status, out = await h.post("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
            assert status == 200 and h.decoders[0].metaserver_results == [OK, OK]
            assert h.prefillers[0].bodies == [], "no prefill for a prompt the decoder already holds"
            assert 'lw_proxy_prefill_dispatches_total{outcome="skipped"} 1.0' in await h.metrics()

            h.decoders[0].knobs.needs_prefill = True  # one child that needs it is enough
            status, _ = await h.post("/v1/completions", {"prompt": "c", "max_tokens": 2})
            assert status == 200 and len(h.prefillers[0].bodies) == 1

    run(body())


def test_a_skipped_prefill_is_dispatched_for_a_retried_decoder_that_needs_it():
    async def body():
        async with harness() as h:
            parent = h.proxy.registry.open(1, parse_completion(b'{"prompt": "x"}'))
            assert await h.proxy.registry.arrive(parent.id, "r1", needs_prefill=False) == (200, OK_BODY)
            h.proxy.registry.retry(parent)  # that decoder failed; the next one may not hold the prompt
            s, _ = await h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": "r2"})
            assert s == 200 and len(h.prefillers[0].bodies) == 1
            h.proxy.registry.close(parent)

    run(body())


def test_settle_waits_for_every_choices_post_and_no_longer_than_its_bound():
    """``Parent.settle``: whether the decoder continues from the prefill's tokens, once every
    choice's engine request said so (a POST with or without ``forces_first``), else at the bound."""
    async def body():
        async with harness() as h:
            reg = h.proxy.registry
            parent = reg.open(2, parse_completion(b'{"prompt": "x", "n": 2, "temperature": 1}'))
            parent.answers = {0: OK_BODY, 1: OK_BODY}  # the prefill answered both choices
            parent.result = (200, OK_BODY)
            t0 = asyncio.get_running_loop().time()
            assert await parent.settle(frozenset({0, 1}), 0.2) is False
            assert asyncio.get_running_loop().time() - t0 >= 0.19  # nobody POSTed: the bound
            waiting = asyncio.ensure_future(parent.settle(frozenset({0, 1}), 5.0))
            rid = f"cmpl-lw-{parent.id}-0-abcdefgh"  # as vLLM names a request's engine requests
            await reg.arrive(parent.id, f"0_{rid}", forces_first=True)
            await asyncio.sleep(0.05)
            assert not waiting.done()  # choice 1 has not said
            await reg.arrive(parent.id, f"1_{rid}", forces_first=True)
            assert await asyncio.wait_for(waiting, 1.0) is True
            other = reg.open(1, parse_completion(b'{"prompt": "x", "temperature": 1}'))
            other.answers, other.result = {0: OK_BODY}, (200, OK_BODY)
            waiting = asyncio.ensure_future(other.settle(frozenset({0}), 5.0))
            await reg.arrive(other.id, "r", forces_first=None)  # it said: it does not continue from the token
            assert await asyncio.wait_for(waiting, 1.0) is False
            reg.close(parent)
            reg.close(other)

    run(body())
