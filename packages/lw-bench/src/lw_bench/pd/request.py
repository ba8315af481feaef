"""One request of ``lw-bench pd`` (lw_bench.pd.mode, lw_bench.pd.compare): the try-out model's
plain token ids, a streamed completion's TTFT, the engines' stats records, and where a PD
request's time went (``breakdown``)."""

from __future__ import annotations

import http.client
import json
import random
import time
from typing import Any

VOCAB_LO, VOCAB_HI = 10, 500  # plain token ids of the tiny tokenizer (no specials)
PD_MAX_TOKENS = 2


def stream_ttft(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[float, float, int]:
    """POST a streamed completion; (send time, first content chunk time, status), wall clock."""
    return first_content(url, "/v1/completions", {**body, "stream": True}, timeout_s)


def first_content(url: str, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[float, float, int]:
    """POST ``body`` to ``path``; (send time, time of the first event that carries a generated
    token -- completion ``text``, chat ``delta.content`` outside the role event, empty text
    included: a token whose text the detokenizer holds back is streamed with empty text -- or, not
    streamed, of the whole answer, status), wall clock. A stream is read to its end (and dropped)
    so the request finishes normally."""
    t_send, times, status = token_times(url, path, body, timeout_s)
    return t_send, times[0], status


def token_times(url: str, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[float, list[float], int]:
    """``first_content``, with the time of every event of the stream's first token's choice that
    carries a token (``token_event``), in order: (send time, times, status); not streamed, or a
    stream none of whose events carried a token, the time of its end alone."""
    host, port = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        t_send = time.time()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200 or not body.get("stream"):
            r.read()
            return t_send, [time.time()], r.status
        times: list[float] = []
        choice = None
        for line in r:
            if line.startswith(b"data: {") and b'"choices"' in line:
                t = time.time()
                ev = json.loads(line[6:])
                for c in ev.get("choices") or ():
                    if not token_event(c):
                        continue
                    if choice is None:
                        choice = c.get("index", 0)
                    if c.get("index", 0) == choice:
                        times.append(t)
                        break
        return t_send, times or [time.time()], r.status
    finally:
        conn.close()


def token_event(choice: dict[str, Any]) -> bool:
    """A stream event's choice carries a generated token: a completion's ``text``, a chat delta's
    ``content`` (not the role event a chat stream opens with) or ``tool_calls``."""
    if isinstance(choice.get("text"), str):
        return True
    delta = choice.get("delta") or {}
    return (isinstance(delta.get("content"), str) or bool(delta.get("tool_calls"))) and "role" not in delta


def _records(server: Any, want: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        recs = server.new_stats()
        if len(recs) >= want or time.monotonic() > deadline:
            return recs
        time.sleep(0.02)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def breakdown(t_send: float, t_first: float, d: dict[str, Any], p: dict[str, Any] | None) -> dict[str, float | None]:
    """Seconds per phase of one PD request (None where a milestone is missing, e.g. no prefill)."""
    dt, pt = d.get("t", {}), (p or {}).get("t", {})

    def span(a: float | None, b: float | None) -> float | None:
        return round(b - a, 4) if a and b else None

    load_start = dt.get("load_start") or dt.get("sched")
    load_done = dt.get("load_done") or load_start
    return {
        "proxy_dispatch": span(t_send, dt.get("arrival")),
        "decoder_sched": span(dt.get("arrival"), dt.get("posted")),
        "metaserver_wait": span(dt.get("posted"), pt.get("arrival")),
        "prefill": span(pt.get("arrival"), pt.get("step_done")),
        # Negative: the decoder found the prompt in the pool before the prefiller's step reported.
        "answer_relay": span(pt.get("step_done"), dt.get("seen")),
        "decoder_resched": span(dt.get("seen"), load_start),
        "load": span(load_start, load_done),
        "decoder_compute": span(load_done, dt.get("step_done")),
        "first_byte_relay": span(dt.get("step_done"), t_first),
    }
