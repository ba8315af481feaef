"""Streaming PD (``pd_streaming``) with ``"backend": "memcache"`` on real vLLM (CPU, tiny GQA):
prefiller and decoder are clients of one MetaService whose memory ``lw-memcache hold`` lends; the
decoder, parked before its prefill exists, pulls each layer as the prefiller publishes it (through
the memcache streaming extension: token-named segment objects), and the greedy output equals the
single engine's, every chunk streamed, well before the deadline. One stack (~2 min to start).

The decoder-first exchange is the one tests/pd's streaming modules use (lw_dev.pd_streaming_flow)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mc_support import HAVE_MEMCACHE, needs_memcache

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_bench.pd.stack import Stack, start_stack  # noqa: E402
from lw_dev.pd_flow import text  # noqa: E402
from lw_dev.pd_oracle import SAMPLING  # noqa: E402
from lw_dev.pd_streaming_flow import streams_in_decoder_first  # noqa: E402

pytestmark = [needs_memcache, pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def mc_stream_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not HAVE_MEMCACHE:
        pytest.skip(needs_memcache.kwargs["reason"])
    from lw_memcache.local import LocalMemcache

    log_dir = tmp_path_factory.mktemp("pd-stream-memcache")
    m = LocalMemcache(dram_size="128MB", workdir=log_dir / "pool", stop_timeout_s=3, holder=True)
    m.start()
    try:
        stack = start_stack("gqa", log_dir, str(log_dir / "unused-embedded"), metaserver_timeout_s=TIMEOUT_S,
                            extra={**m.extra_config, "pd_streaming": True})
        try:
            yield stack
        finally:
            stack.stop()
    finally:
        m.stop()


def test_memcache_decoder_first_then_the_prefill_streams_in(mc_stream_stack: Stack) -> None:
    body = {"model": "tiny", "prompt": text(61, 160), "max_tokens": 8, "logprobs": 2, **SAMPLING}
    rec = streams_in_decoder_first(mc_stream_stack, body, "parent-memcache-late", "memcache streaming", TIMEOUT_S)
    assert rec["prompt_tokens"] > 4 * mc_stream_stack.block_size, rec
