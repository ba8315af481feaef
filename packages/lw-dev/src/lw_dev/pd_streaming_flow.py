"""Shared by the streaming PD modules: a module-scoped stack with ``pd_streaming`` on, and the
"decoder first, prefill later" exchange that always takes the streaming receive."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lw_bench.pd.stack import Stack, post_json, start_stack
from lw_dev.fake_metaserver import FakeMetaserver
from lw_dev.pd_flow import baseline
from lw_dev.pd_oracle import assert_same, completion_choice

# The hybrids' streaming stacks (tests/pd/conftest.py): a prefill that never comes is recomputed
# after this receive deadline, which their tests time against.
STREAM_TIMEOUT_S = 12.0


def streaming_stack(model: str, timeout_s: float, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")
    log_dir = tmp_path_factory.mktemp(f"pd-streaming-{model}")
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else log_dir
    pool = base / f"lw-pd-stream-pool-{uuid.uuid4().hex[:8]}"
    # Non-streamed answers too take the streaming receive (not a continuation after the prefill).
    stack = start_stack(model, log_dir, str(pool), metaserver_timeout_s=timeout_s, extra={"pd_streaming": True},
                        proxy_flags=("--no-continue-after-prefill",))
    try:
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(pool, ignore_errors=True)


def decoder_first(stack: Stack, body: dict[str, Any], parent: str, *, host: str = "127.0.0.1",
                  port: int | None = None) -> tuple[int, Any, float]:
    """Send ``body`` to the decoder as a remote-prefill request, let it park and open its chunks
    for a second (nothing is reserved yet), then run the prefill straight on the prefiller.
    Returns the decoder's (status, body) and seconds taken. The fake metaserver answers "ok" once
    the prefiller has answered, as the proxy does: the decoder's receive takes that answer for
    "what is not in the pool now never comes". ``host``: the fake's address, one the decoder
    reaches (a namespace host's, called from inside it); ``port``: the fake's, one the decoder's
    ``pd_allowed_metaservers`` lists (a free one by default, which a loopback host needs not)."""
    fake = FakeMetaserver(host, port)
    fake.mode = "held"
    try:
        params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": fake.url,
                  "lw_parent_id": parent, "lw_children": 1}
        stack.decode.mark()
        got: dict[str, Any] = {}

        def decode() -> None:
            got["answer"] = post_json(stack.decode.url + "/v1/completions", {**body, "kv_transfer_params": params})

        t0 = time.monotonic()
        th = threading.Thread(target=decode, daemon=True)
        th.start()
        time.sleep(1.0)  # the decoder parks and retries open_streaming
        assert th.is_alive(), got
        status, out = post_json(stack.prefill.url + "/v1/completions",
                                {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                                  "lw_parent_id": parent}})
        assert status == 200, out
        fake.release()  # the prefill is done and committed
        th.join(60)
        took = time.monotonic() - t0
    finally:
        fake.close()
    assert "answer" in got, "the decoder did not answer within 60 s"
    status, out = got["answer"]
    return status, out, took


def streams_in_decoder_first(stack: Stack, body: dict[str, Any], parent: str, label: str,
                             timeout_s: float, *, host: str = "127.0.0.1", port: int | None = None) -> dict[str, Any]:
    """``decoder_first``, checked: the output is the single engine's, the decoder streamed the
    whole prompt but its last token (every chunk landed) and its receive ended with the prefill,
    long before ``timeout_s``. Returns the decoder's stats record."""
    ref = completion_choice(baseline(stack, "/v1/completions", body)["choices"][0])
    status, out, took = decoder_first(stack, body, parent, host=host, port=port)
    assert status == 200, out
    assert_same(ref, completion_choice(out["choices"][0]), label)
    assert took < timeout_s, f"{took:.1f} s: the decoder waited for its deadline instead of streaming"
    (rec,) = stack.decode.new_stats()
    n = rec["prompt_tokens"]
    assert rec["remote_prefill"] == "streaming", rec
    assert rec["promised_tokens"] == rec["loaded_tokens"] == n - 1 and rec["failed_blocks"] == 0, rec
    t = rec["t"]  # the receive ended with the prefill, not at its deadline
    assert t["load_done"] - t["stream_sent"] < timeout_s / 2, t
    return rec
