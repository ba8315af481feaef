"""Streaming PD with the tiny MLA model (block 16) on real vLLM: the decoder, parked before its
prefill exists, pulls the latent KV layer by layer as the prefiller publishes it; the greedy
output equals the single engine's and every chunk arrives, well before the deadline."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lw_bench.pd.stack import Stack
from lw_dev.pd_flow import text
from lw_dev.pd_oracle import SAMPLING
from lw_dev.pd_streaming_flow import streaming_stack, streams_in_decoder_first

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def mla_stream_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from streaming_stack("mla", TIMEOUT_S, tmp_path_factory)


def test_mla_decoder_first_then_the_prefill_streams_in(mla_stream_stack: Stack) -> None:
    body = {"model": "tiny", "prompt": text(51, 100), "max_tokens": 8, "logprobs": 2, **SAMPLING}
    rec = streams_in_decoder_first(mla_stream_stack, body, "parent-mla-late", "MLA streaming", TIMEOUT_S)
    assert rec["prompt_tokens"] > 4 * mla_stream_stack.block_size, rec
