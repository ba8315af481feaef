"""``lw-bench pd`` (lw_bench.pd.compare*, lw_bench.pd.throttle): the throttled store, the per-layer
timeline, the report's shape; and one quick run on real vLLM (one store, tiny prompt, one rep).
No timing claims beyond what the throttle itself guarantees (it sleeps at least nbytes/bandwidth)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from lw_bench.pd import compare, compare_report, compare_stack, request, request_kinds
from lw_bench.pd import mode as bench_pd
from lw_bench.pd.result import checked
from lw_bench.pd.throttle import NAME, ThrottledBackend
from lw_core.backends.memory import MemoryBackend
from lw_core.backends.registry import register_backend, unregister_backend
from lw_core.config import ConfigError, parse_config

MB = 1 << 20


def test_throttle_serialises_transfers_on_one_link_and_records_them(tmp_path: Path) -> None:
    tl = tmp_path / "tl.jsonl"
    be = ThrottledBackend(MemoryBackend(16 * MB), bytes_per_s=20 * MB, timeline_path=str(tl))
    try:
        (h,) = be.reserve(["k"], 2 * MB)
        assert be.view(h, 0, MB) is None  # throttled: every byte goes through write/read
        t0 = time.monotonic()
        be.write([h], [0], [bytearray(MB)])
        be.write([h], [MB], [bytearray(MB)])
        assert time.monotonic() - t0 >= 2 * MB / (20 * MB) * 0.95  # 2 MiB at 20 MiB/s, one after the other
        be.publish([h], MB)
        be.commit([h])
        (r,) = be.open(["k"])
        dst = bytearray(MB)
        be.read([r], [MB], [dst])
        be.release([r])
    finally:
        be.close()
    evs = [json.loads(x) for x in tl.read_text().splitlines()]
    assert [e["op"] for e in evs] == ["reserve", "write", "write", "publish", "commit", "read"]
    assert evs[0]["nbytes"] == 2 * MB and evs[2]["off"] == MB and evs[3]["upto"] == MB and evs[5]["off"] == MB
    assert all(e["t"] >= e["t0"] > 0 for e in evs)


def test_unthrottled_keeps_views_and_the_plugin_parses_strictly(tmp_path: Path) -> None:
    be = ThrottledBackend(MemoryBackend(4 * MB))
    try:
        (h,) = be.reserve(["k"], MB)
        be.view(h, 0, MB)  # passed through (the memory backend's own answer)
        be.abort([h])
    finally:
        be.close()
    register_backend(NAME, "lw_bench.pd.throttle:PLUGIN")
    try:
        cfg = parse_config({"backend": NAME, "embedded_path": str(tmp_path / "pool"), "throttle_bytes_per_s": 5})
        assert cfg.backend_keys.throttle_bytes_per_s == 5
        with pytest.raises(ConfigError, match="throttle_bytes_per_s"):
            parse_config({"backend": NAME, "throttle_bytes_per_s": -1})
    finally:
        unregister_backend(NAME)


def _events(t: float, layer_nbytes: int) -> tuple[list[dict], list[dict]]:
    """A 4-layer streamed PD request: the prefiller writes and publishes layer i at t+10i ms, the
    decoder reads it 3 ms later, taking 2 ms."""
    pev = [{"op": "reserve", "t0": t, "t": t, "n": 2, "nbytes": 4 * layer_nbytes}]
    dev = []
    for i in range(4):
        ts = t + 0.010 * (i + 1)
        pev += [{"op": "write", "t0": ts - 0.001, "t": ts, "n": 2, "nbytes": 2 * layer_nbytes, "off": i * layer_nbytes},
                {"op": "publish", "t0": ts, "t": ts + 0.0005, "n": 2, "nbytes": 0, "upto": (i + 1) * layer_nbytes}]
        dev.append({"op": "read", "t0": ts + 0.001, "t": ts + 0.003, "n": 2, "nbytes": 2 * layer_nbytes,
                    "off": i * layer_nbytes})
    return pev, dev


def test_timeline_puts_each_layer_on_the_clients_clock() -> None:
    pev, dev = _events(100.0, 4096)
    tl = compare.timeline(pev, dev, 100.0, 100.050)
    assert [x["layer"] for x in tl["layers"]] == [0, 1, 2, 3]
    assert tl["layers"][3]["prefill_saved"] == 40.0 and tl["layers"][3]["prefill_published"] == 40.5
    assert tl["layers"][3]["decoder_landed"] == 43.0 and tl["layer_transfer_ms"] == 2.0 and tl["ttft_ms"] == 50.0
    assert compare.ready_after_last_layer(tl) == 2.5
    # Chunked prefill: a second step publishes layers 0.. again; the decoder waits for that one.
    later = [{**e, "t0": e["t0"] + 0.1, "t": e["t"] + 0.1} for e in pev if e["op"] in ("write", "publish")]
    tl2 = compare.timeline(pev + later, dev, 100.0, 100.2)
    assert tl2["layers"][0]["prefill_published"] == 110.5 and tl2["layers"][3]["prefill_published"] == 140.5
    empty = compare.timeline([], [], 100.0, 100.1)
    assert empty["layers"] == [] and compare.ready_after_last_layer(empty) is None


def _records() -> list[dict]:
    out = []
    for store in ("embedded", "throttled"):
        for rep in range(2):
            for kind, ttft in (("alone", 0.10), ("pd", 0.13), ("pd_stream", 0.11), ("pd_relay", 0.105),
                               ("pd_stream_relay", 0.102)):
                rec = {"store": store, "kind": kind, "length": 256, "rep": rep, "status": 200, "ttft_s": ttft,
                       "after_prefill_s": ttft - 0.09}
                if kind in compare.RELAY_KINDS:
                    rec["relayed"] = rep == 0  # one of the two reps had its first token relayed
                    rec["ttft_s"] = ttft if rep == 0 else 0.2
                if kind == "alone":
                    rec["phases"] = {"prefill": 0.09}
                else:
                    pev, dev = _events(1000.0, 4096)
                    rec["phases"] = {ph: 0.01 for ph in bench_pd.PHASES}
                    rec["decoder"] = {"prompt_tokens": 256, "promised_tokens": 255, "loaded_tokens": 255,
                                      "remote_prefill": "streaming" if kind in compare.STREAMING_KINDS else "ok"}
                    rec["timeline"] = compare.timeline(pev, dev, 1000.0, 1000.0 + ttft)
                out.append(rec)
    return out


def test_summary_shape_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"lengths": [256], "reps": 2, "block_size": 128, "pd_max_tokens": 2, "throttle_bytes_per_s": 50_000_000}
    r = compare.summarize(cfg, _records())
    assert r["problems"] == [] and r["stores"] == ["embedded", "throttled"]
    for store in r["stores"]:
        assert set(r["ttft_s"][store]["256"]) == {"alone", "pd", "pd_stream", "pd_relay", "pd_stream_relay"}
        ra = r["ratios"][store]["256"]
        assert ra["pd_vs_alone"] == pytest.approx(1.3) and ra["pd_stream_vs_alone"] == pytest.approx(1.1)
        assert ra["pd_relay_vs_alone"] == pytest.approx((1.05 + 2.0) / 2) and ra["pd_stream_vs_pd"] > 0
        assert ra["pd_stream_relay_vs_alone"] == pytest.approx((1.02 + 2.0) / 2) and ra["pd_relay_vs_pd"] > 0
        assert ra["pd_stream_relay_vs_pd_stream"] == pytest.approx((0.102 / 0.11 + 0.2 / 0.11) / 2, abs=1e-4)
        # the relayed requests alone: the one relayed rep of each
        assert ra["pd_relay_relayed_share"] == 0.5 and ra["pd_relay_relayed_vs_alone"] == pytest.approx(1.05)
        assert ra["pd_stream_relay_relayed_share"] == 0.5 and ra["pd_stream_relay_relayed_vs_alone"] == pytest.approx(1.02)
        assert r["transfer_hidden"][store]["256"]["pd_stream"]["ready_after_last_layer_ms"] == 2.5
        assert r["after_prefill_s"][store]["256"]["pd"] == pytest.approx(0.04)
    compare_report.print_table(r)
    printed = capsys.readouterr().out
    assert "| throttled (50 MB/s link per engine) | 256 | 100.0 | 130.0 | 110.0 | 152.5 | 151.0 | 1.30 | 1.10 | 1.52 | 1.51 |" in printed
    assert "throttled 256: pd_relay 50% relayed, 1.05 x alone, pd_stream_relay 50% relayed, 1.02 x alone" in printed
    compare_report.plot_ttft(r, str(tmp_path / "ttft.png"))
    compare_report.plot_timeline(r, str(tmp_path / "timeline.png"))
    assert (tmp_path / "ttft.png").stat().st_size > 1000 and (tmp_path / "timeline.png").stat().st_size > 1000


def test_bad_flags_name_the_flag() -> None:
    p = argparse.ArgumentParser()
    bench_pd.add_arguments(p)
    for argv, flag in ((["--stores", "disk"], "--stores"), (["--lengths", "5000"], "--lengths"),
                       (["--throttle-mb-s", "0"], "--throttle-mb-s"), (["--request-kinds", "chat,x"], "--request-kinds")):
        with pytest.raises(SystemExit, match=flag):
            bench_pd.config(p.parse_args(argv))


def test_memcache_store_wraps_lw_memcache_with_its_keys(tmp_path: Path) -> None:
    register_backend(NAME, "lw_bench.pd.throttle:PLUGIN")
    try:
        extra = compare_stack.engine_extra("memcache", "unused", tmp_path / "tl.jsonl", streaming=True, bytes_per_s=5,
                                           metaserver_timeout_s=3.0,
                                           memcache={"backend": "memcache", "memcache_config_path": "/x/mmc.conf",
                                                     "memcache_protocol": "host_shm"})
        k = parse_config(extra).backend_keys
        assert (k.throttle_inner, k.memcache_config_path, k.throttle_bytes_per_s) == ("memcache", "/x/mmc.conf", 0)
        with pytest.raises(ConfigError, match="throttle_inner"):
            parse_config({**extra, "throttle_inner": "disk"})
    finally:
        unregister_backend(NAME)


def test_request_kinds_flag_bodies_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert request_kinds.parse("all") == list(request_kinds.REQUEST_KINDS) and request_kinds.parse("none") == []
    assert request_kinds.parse("chat, completion,chat") == ["chat", "completion"]
    for bad in ("", "chat,embeddings", "all,chat"):
        with pytest.raises(SystemExit, match="--request-kinds.*completion_full"):
            request_kinds.parse(bad)
    kinds = request_kinds.REQUEST_KINDS
    b = request_kinds.body(kinds["chat_sampled"], [11, 12], lambda ids: f"text{ids}", max_tokens=2, seed=7)
    assert b["messages"] == [{"role": "user", "content": "text[11, 12]"}] and "prompt" not in b
    assert (b["temperature"], b["top_p"], b["seed"], b["stream"]) == (0.8, 0.95, 7, True)
    b = request_kinds.body(kinds["completion_full"], [11, 12], None, max_tokens=1, seed=7)
    assert (b["prompt"], b["temperature"], b["stream"], b["max_tokens"]) == ([11, 12], 0.0, False, 1) and "seed" not in b
    b = request_kinds.body(kinds["chat_n"], [11, 12], lambda ids: "t", max_tokens=2, seed=7)
    assert (b["n"], b["temperature"], b["stream"]) == (2, 0.8, True)
    b = request_kinds.body(kinds["completion_echo"], [11, 12], lambda ids: "t", max_tokens=2, seed=7)
    assert (b["prompt"], b["echo"], b["stream"]) == ("t", True, True)  # lw-proxy relays an echo of a text prompt
    # The prefiller alone is asked one token: min_tokens no more than that (vLLM refuses more).
    b = request_kinds.body(kinds["completion_list"], [11, 12], None, max_tokens=2, seed=7, more=[[13]])
    assert b["prompt"] == [[11, 12], [13]] and b["stream"] is True
    assert [request_kinds.body(kinds["completion_min_tokens"], [1], None, max_tokens=m, seed=0)["min_tokens"]
            for m in (1, 8)] == [1, 2]
    # A stream's first token is its first event carrying one, empty text included (a held-back
    # partial character), the role event a chat opens with excluded.
    assert [request.token_event(c) for c in ({"text": ""}, {"delta": {"content": ""}},
                                               {"delta": {"role": "assistant", "content": ""}},
                                               {"delta": {}, "finish_reason": "length"},
                                               {"delta": {"tool_calls": [{"index": 0}]}})] == [True, True, False, False, True]
    # Prompts differ per kind and target (a repeated prompt would be a pool hit) and repeat per seed.
    ps = {(k, t): request_kinds.prompt(0, 0, 64, k, t) for k in kinds for t in ("alone", "pd")}
    assert len({tuple(v) for v in ps.values()}) == len(ps) and request_kinds.prompt(0, 0, 64, "chat", "pd") == ps["chat", "pd"]

    recs = []
    for rep, (alone, pd, relayed) in enumerate(((0.10, 0.12, True), (0.20, 0.30, False), (0.10, 0.13, True))):
        recs.append({"store": "embedded", "request_kind": "chat", "target": "alone", "length": 256, "rep": rep,
                     "status": 200, "ttft_s": alone})
        recs.append({"store": "embedded", "request_kind": "chat", "target": "pd", "length": 256, "rep": rep,
                     "status": 200, "ttft_s": pd, "relayed": relayed, **({} if relayed else {"not_relayed": "token"}),
                     "first_gap_s": 0.02 * (rep + 1), "next_gap_s": 0.005})
    recs.append({"store": "embedded", "request_kind": "completion_full", "target": "pd", "length": 256, "rep": 0,
                 "status": 500, "ttft_s": 0.01})
    recs.append({"store": "embedded", "request_kind": "completion_full", "target": "alone", "length": 256, "rep": 0,
                 "status": 200, "ttft_s": 0.2})
    figures, problems = request_kinds.summarize(recs)
    chat = figures["embedded"]["256"]["chat"]
    assert chat == {"alone_s": 0.1, "pd_s": 0.13, "pd_vs_alone": 1.3, "relayed_share": 0.67, "not_relayed": {"token": 1},
                    "first_gap_s": 0.04, "next_gap_s": 0.005}
    full = figures["embedded"]["256"]["completion_full"]
    assert full == {"alone_s": 0.2, "pd_s": None, "pd_vs_alone": None, "relayed_share": None, "not_relayed": {},
                    "first_gap_s": None, "next_gap_s": None}
    assert problems == ["embedded completion_full pd 256: HTTP 500"]
    cfg = {"lengths": [256], "reps": 2, "block_size": 128, "pd_max_tokens": 2, "throttle_bytes_per_s": 50_000_000}
    r = compare.summarize(cfg, _records())
    r.update(request_kinds=figures, request_kind_records=recs, runtime_s=1.0, loadavg=0.5, cpus=2,
             config={**cfg, "quick": False, "max_model_len": 1024, "streaming": False, "stores": ["embedded"],
                     "relay": True, "pin": True, "request_kinds": ["chat", "completion_full"]})
    checked(r)  # the report's struct takes the figures
    compare_report.print_table(r)
    printed = capsys.readouterr().out
    assert "| embedded | 256 | chat | yes | 100.0 | 130.0 | 1.30 | 67% | token 1 | 40.0 / 5.0 |" in printed
    assert "| embedded | 256 | completion_full | no | 200.0 | - | - | - | - | - |" in printed


def test_token_times_follow_the_first_tokens_choice() -> None:
    """A stream's token times are those of the choice whose token came first (its role event and
    the other choices' events left out); a non-streamed answer has its end's time alone."""
    import http.server
    import threading

    events = [{"index": 0, "delta": {"role": "assistant", "content": ""}}, {"index": 1, "delta": {"content": "a"}},
              {"index": 0, "delta": {"content": "b"}}, {"index": 1, "delta": {"content": ""}},
              {"index": 1, "delta": {"content": "c"}}, {"index": 1, "delta": {}, "finish_reason": "length"}]

    class Sse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for ch in events:
                self.wfile.write(b"data: " + json.dumps({"choices": [ch]}).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.01)
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Sse)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        t_send, times, status = request.token_times(url, "/v1/chat/completions", {"stream": True})
        assert status == 200 and len(times) == 3 and t_send <= times[0] <= times[1] <= times[2]
        assert times[1] - times[0] >= 0.015  # choice 0's event between them is not one of its
        _, times, _ = request.token_times(url, "/v1/chat/completions", {"stream": False})
        assert len(times) == 1
        events[:] = [events[0], events[-1]]  # a stream with no token event: its end's time
        t_send, times, _ = request.token_times(url, "/v1/chat/completions", {"stream": True})
        assert len(times) == 1 and times[0] >= t_send + 0.015
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow
def test_quick_run_on_real_vllm(tmp_path: Path) -> None:
    """The default store, one tiny prompt per kind: the report has every row, positive figures, a
    timeline per PD request, and the JSON and both figures under --out. Everything after a store's
    stack is store-agnostic; the memcache store's wrapping is checked above without an engine, and
    memcache under real vLLM PD in tests/memcache."""
    store = "throttled"
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")
    p = argparse.ArgumentParser()
    bench_pd.add_arguments(p)
    p.add_argument("--json", action="store_true")
    out = tmp_path / "out"
    r = bench_pd.run(p.parse_args(["--quick", "--stores", store, "--out", str(out), "--json",
                                   "--log-dir", str(tmp_path / "logs")]))
    assert r["problems"] == [], r["problems"]
    assert r["stores"] == [store]
    tt = r["ttft_s"][store]["200"]
    assert set(tt) == {"alone", "pd", "pd_stream", "pd_relay", "pd_stream_relay", "turn2"} and all(v > 0 for v in tt.values()), tt
    ra = r["ratios"][store]["200"]
    assert all(v > 0 for k, v in ra.items() if "relayed" not in k), ra
    assert all(0 <= ra[f"{k}_relayed_share"] <= 1 for k in compare.RELAY_KINDS), ra  # relayable or not: model's token
    assert all(isinstance(rec["relayed"], bool) for rec in r["records"] if rec["kind"] in compare.RELAY_KINDS)
    assert set(r["after_prefill_s"][store]["200"]) == set(tt)
    for rec in r["records"]:
        if rec["kind"] in compare.PD_KINDS:
            layers = rec["timeline"]["layers"]
            assert len(layers) == compare.NUM_LAYERS, rec
            assert all(x["decoder_landed"] is not None and x["prefill_saved"] is not None for x in layers), rec
    # Every request kind, alone and through the default proxy (prefill-first, streaming decoder).
    by_kind = r["request_kinds"][store]["200"]
    assert set(by_kind) == set(request_kinds.REQUEST_KINDS), by_kind
    assert all(f["alone_s"] > 0 and f["pd_s"] > 0 and f["pd_vs_alone"] > 0 and 0 <= f["relayed_share"] <= 1
               for f in by_kind.values()), by_kind
    assert {(x["request_kind"], x["target"]) for x in r["request_kind_records"]} == {
        (k, t) for k in request_kinds.REQUEST_KINDS for t in ("alone", "pd")}
    assert json.loads((out / "result.json").read_text())["stores"] == [store]
    assert (out / "ttft.png").stat().st_size > 1000 and (out / "timeline.png").stat().st_size > 1000
