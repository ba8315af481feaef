"""``lw-bench pd``: TTFT of the 1P1D stack against the prefiller alone, non-streaming vs streaming PD.

One run, per store (``--stores``: ``embedded``; ``throttled``: the embedded pool behind a link
of ``--throttle-mb-s`` per engine process, lw_bench.pd.throttle; ``memcache``: lw-memcache with a
MetaService and a holder on this host), starts ONE prefiller serving a
non-streaming and a streaming decoder, each behind its own ``lw-proxy`` (``--no-prefill-first``:
the decoder's path), plus (unless ``--no-relay``) one proxy with ``--prefill-first`` (lw-proxy's
default) in front of each (lw_bench.pd.compare_stack). Per length and rep it alternates, on fresh random-token prompts:

* ``alone``: a streamed ``max_tokens: 1`` completion straight to the prefiller;
* ``pd`` / ``pd_stream`` / ``pd_relay`` / ``pd_stream_relay``: a streamed completion through the
  matching proxy; TTFT = time to the first content chunk.

Per PD request it records where the time went (``breakdown``: proxy dispatch, decoder scheduling,
metaserver wait, prefill, answer relay, decoder rescheduling, load, decoder compute, first byte
relayed; from the client's clock and the wall-clock milestones both connectors write into their
stats records, ``LW_VLLM_STATS_FILE``, field ``t``) and a per-layer timeline (prefiller layer
saved/published vs decoder layer landed, from the backend's call timeline). Headline: median
ratios of per-rep pairs, PD / alone (target <= 1.10) and streaming PD / alone (target <= 1.03).
Then, per kind of client request (``--request-kinds``, lw_bench.pd.request_kinds: completion and
chat, streamed or not, greedy, sampled, with log-probs), the prefiller alone against the default
proxy, and the share of first tokens relayed. ``--out DIR`` writes ``result.json``, ``ttft.png`` and ``timeline.png``. The report is a
``lw_bench.pd.result.PdBenchResult`` (its fields are the JSON's keys). ``--quick`` is a smoke
run (one length of 200 tokens, one rep).

``measure``/``summarize`` below are the older single-stack measurement (kinds pd, alone, turn2 on
a ``start_stack`` stack), kept for the PD test modules' bench rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from lw_bench.pd import request_kinds
from lw_bench.pd.report import PHASES, plot, print_table  # noqa: F401  (re-exported: the PD tests use them)
from lw_bench.pd.request import PD_MAX_TOKENS, _prompt, _records, breakdown, stream_ttft

TARGET_RATIO = 1.10
STREAM_TARGET_RATIO = 1.03


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,2048,4000",
                   help="prompt lengths in tokens, each 16..4032 (the try-out model has 4096 positions; default 1024,2048,4000)")
    p.add_argument("--reps", type=int, default=3, help="requests of each kind per length and store; medians are reported (default 3)")
    p.add_argument("--block-size", type=int, default=128, choices=(16, 32, 64, 128),
                   help="vLLM block size = pool chunk size (default 128, vLLM CPU's default)")
    p.add_argument("--stores", default="embedded,throttled",
                   help="comma-separated: embedded, throttled, memcache (default embedded,throttled; one "
                        "stack each; memcache starts a MetaService and a holder on this host)")
    p.add_argument("--throttle-mb-s", type=float, default=50.0,
                   help="bandwidth of the throttled store's link per engine process, MB/s (10^6 bytes; default 50)")
    p.add_argument("--request-kinds", default="all",
                   help="kinds of client request measured alone and through the default proxy (lw_bench.pd.request_kinds): "
                        "all, none, or a comma-separated list of completion, completion_full, completion_sampled, "
                        "completion_logprobs, chat, chat_full, chat_sampled, chat_logprobs, completion_n, chat_n, "
                        "completion_full_sampled, chat_full_sampled, completion_full_stop, completion_echo, "
                        "completion_min_tokens, completion_list, chat_tools (default all)")
    p.add_argument("--no-relay", action="store_true", help="do not measure the proxy's --prefill-first (rows pd_relay, pd_stream_relay)")
    p.add_argument("--continue-streams", action="store_true",
                   help="the prefill-first proxies run lw-proxy --continue-streams (streams of one choice continued "
                        "after their prefill)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not keep the prefiller's processes (API server and engine) alone on the first CPU; by "
                        "default the decoders, proxies and this client share the second, as P and D hosts would not "
                        "share cores")
    p.add_argument("--out", default=None, metavar="DIR", help="write result.json, ttft.png and timeline.png here")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="also write the TTFT figure here (needs matplotlib)")
    p.add_argument("--save", default=None, metavar="OUT.json", help="also write the JSON object to this file")
    p.add_argument("--log-dir", default=None, help="keep the servers' logs, stats and timelines here (default: a temporary dir, removed)")
    p.add_argument("--quick", action="store_true", help="smoke run: length 200, 1 rep")
    p.add_argument("--streaming", action="store_true", help="accepted for compatibility: streaming PD is always measured")


MAX_LENGTH = 4032  # the try-out model's 4096 positions, less the generated tokens and some room


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"lw-bench pd: --lengths={text!r}: expected comma-separated integers, e.g. 1024,2048") from None
    if not out or any(not 16 <= x <= MAX_LENGTH for x in out):
        raise SystemExit(f"lw-bench pd: --lengths={text!r}: each length must be in [16, {MAX_LENGTH}]")
    return out


def _stores(text: str) -> list[str]:
    from lw_bench.pd.compare_stack import STORES

    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in STORES]
    if not out or bad:
        raise SystemExit(f"lw-bench pd: --stores={text!r}: expected a comma-separated list of {', '.join(STORES)}")
    return list(dict.fromkeys(out))


def config(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [200] if args.quick else _lengths(args.lengths)
    reps = 1 if args.quick else args.reps
    if reps < 1:
        raise SystemExit(f"lw-bench pd: --reps={reps}: must be >= 1")
    mbs = getattr(args, "throttle_mb_s", 50.0)
    if not mbs > 0:
        raise SystemExit(f"lw-bench pd: --throttle-mb-s={mbs}: must be > 0 (MB/s)")
    return {"lengths": lengths, "reps": reps, "block_size": args.block_size, "pd_max_tokens": PD_MAX_TOKENS,
            "quick": bool(args.quick), "max_model_len": min(4096, max(1024, max(lengths) + 64)),
            "streaming": bool(getattr(args, "streaming", False)),
            "stores": _stores(getattr(args, "stores", "embedded,throttled")),
            "throttle_bytes_per_s": int(mbs * 1e6), "relay": not getattr(args, "no_relay", False),
            "request_kinds": request_kinds.parse(getattr(args, "request_kinds", "all")),
            "pin": not getattr(args, "no_pin", False), "continue_streams": bool(getattr(args, "continue_streams", False))}


def measure(stack: Any, cfg: dict[str, Any], *, seed: int = 0, progress: Any = None,
            suffix: str = "") -> list[dict[str, Any]]:
    """Run the alternated PD / alone requests on a started stack; one record per request. Kinds
    are ``pd``/``alone`` plus ``suffix``; second turns only without one. The PD and alone prompts
    depend on (seed, rep, length) alone, so a second stack measures the very same prompts."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for rep in range(cfg["reps"]):
        for length in cfg["lengths"]:
            pr = random.Random(f"{seed}/{rep}/{length}")
            prompts = {"pd": _prompt(pr, length), "alone": _prompt(pr, length)}
            order = ("pd", "alone") if (rep + length // 16) % 2 == 0 else ("alone", "pd")
            for base in order:
                kind = base + suffix
                body = {"model": "tiny", "prompt": prompts[base], "temperature": 0.0, "ignore_eos": True,
                        "max_tokens": cfg["pd_max_tokens"] if base == "pd" else 1}
                stack.decode.mark()
                stack.prefill.mark()
                url = stack.proxy.url if base == "pd" else stack.prefill.url
                t_send, t_first, status = stream_ttft(url, body)
                rec: dict[str, Any] = {"kind": kind, "length": length, "rep": rep, "status": status,
                                       "ttft_s": round(t_first - t_send, 4)}
                precs = _records(stack.prefill, 1)
                p = precs[0] if precs else None
                if base == "pd":
                    drecs = _records(stack.decode, 1)
                    d = drecs[0] if drecs else {}
                    rec["phases"] = breakdown(t_send, t_first, d, p)
                    rec["decoder"] = {k: d.get(k) for k in ("prompt_tokens", "promised_tokens", "loaded_tokens",
                                                           "remote_prefill", "metaserver_wait_s")}
                    rec["prefiller_loaded_tokens"] = p.get("loaded_tokens") if p else None
                else:
                    pt = (p or {}).get("t", {})
                    rec["phases"] = {"dispatch": round(pt["arrival"] - t_send, 4) if pt.get("arrival") else None,
                                     "prefill": round(pt["step_done"] - pt["arrival"], 4) if pt.get("step_done") else None,
                                     "first_byte_relay": round(t_first - pt["step_done"], 4) if pt.get("step_done") else None}
                out.append(rec)
                if progress is not None:
                    progress(rec)
            if suffix:
                continue
            out.append(_second_turn(stack, cfg, rng, length, rep))
            if progress is not None:
                progress(out[-1])
    return out


def _second_turn(stack: Any, cfg: dict[str, Any], rng: random.Random, length: int, rep: int) -> dict[str, Any]:
    """A conversation's second turn through the proxy: turn 1 (half the length) first, then turn 1 +
    as many new tokens; the prefiller loads turn 1's chunks (producer_is_to_load) and computes the rest.
    Its TTFT is compared with the cold PD prompts of the same length."""
    first = _prompt(rng, length // 2)
    body = {"model": "tiny", "temperature": 0.0, "ignore_eos": True, "max_tokens": cfg["pd_max_tokens"]}
    stack.prefill.mark()
    stream_ttft(stack.proxy.url, {**body, "prompt": first})
    _records(stack.prefill, 1)  # its prefill's record is written (maybe after the answer): not read as turn 2's
    stack.decode.mark()
    stack.prefill.mark()
    t_send, t_first, status = stream_ttft(stack.proxy.url, {**body, "prompt": first + _prompt(rng, length - len(first))})
    precs = _records(stack.prefill, 1)
    drecs = _records(stack.decode, 1)
    return {"kind": "turn2", "length": length, "rep": rep, "status": status, "ttft_s": round(t_first - t_send, 4),
            "phases": breakdown(t_send, t_first, drecs[0] if drecs else {}, precs[0] if precs else None),
            "decoder": {k: (drecs[0] if drecs else {}).get(k) for k in ("prompt_tokens", "loaded_tokens", "remote_prefill")},
            "prefiller_loaded_tokens": precs[0].get("loaded_tokens") if precs else None}


# --- figures -------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(cfg: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = ["pd", "alone", "turn2"] + [k for k in ("pd_stream", "alone_stream") if any(r["kind"] == k for r in records)]
    ttft: dict[str, dict[str, float | None]] = {k: {} for k in kinds}
    stream_ratio: dict[str, dict[str, float | None]] = {"pd_stream_vs_alone_stream": {}, "pd_stream_vs_pd": {}}
    ratio: dict[str, float | None] = {}
    turn2_ratio: dict[str, float | None] = {}
    turn2_loaded: dict[str, float | None] = {}
    phases: dict[str, dict[str, float | None]] = {}
    problems: list[str] = []
    for length in cfg["lengths"]:
        L = str(length)
        for kind in kinds:
            rs = [r for r in records if r["length"] == length and r["kind"] == kind]
            problems += [f"{kind} {length}: HTTP {r['status']}" for r in rs if r["status"] != 200]
            ttft[kind][L] = _median([r["ttft_s"] for r in rs if r["status"] == 200])
        # Paired ratios (each PD request against the alone request of its rep): robust to drift.
        pairs: dict[Any, Any] = {}
        for r in records:
            if r["length"] == length and r["status"] == 200:
                pairs.setdefault(r["rep"], {})[r["kind"]] = r["ttft_s"]
        rs_ = [v["pd"] / v["alone"] for v in pairs.values() if v.get("pd") and v.get("alone")]
        ratio[L] = _median(rs_)
        rs_ = [v["turn2"] / v["pd"] for v in pairs.values() if v.get("turn2") and v.get("pd")]
        turn2_ratio[L] = _median(rs_)
        rs_ = [v["pd_stream"] / v["alone_stream"] for v in pairs.values() if v.get("pd_stream") and v.get("alone_stream")]
        stream_ratio["pd_stream_vs_alone_stream"][L] = _median(rs_)
        rs_ = [v["pd_stream"] / v["pd"] for v in pairs.values() if v.get("pd_stream") and v.get("pd")]
        stream_ratio["pd_stream_vs_pd"][L] = _median(rs_)
        turn2_loaded[L] = _median([r["prefiller_loaded_tokens"] for r in records if r["kind"] == "turn2"
                                   and r["length"] == length and r.get("prefiller_loaded_tokens") is not None])
        pd = [r for r in records if r["length"] == length and r["kind"] == "pd"]
        phases[L] = {ph: _median([r["phases"][ph] for r in pd if r["phases"].get(ph) is not None]) for ph in PHASES}
        for r in pd:
            dec = r["decoder"]
            if dec.get("remote_prefill") not in ("ok", "pool holds the prompt", None):
                problems.append(f"pd {length}: remote prefill {dec.get('remote_prefill')!r}")
        for r in records:
            if r["length"] == length and r["kind"] == "pd_stream":
                dec = r["decoder"]
                if dec.get("remote_prefill") not in ("streaming", "pool holds the prompt"):
                    problems.append(f"pd_stream {length}: remote prefill {dec.get('remote_prefill')!r}")
                elif dec.get("loaded_tokens") != dec.get("promised_tokens"):
                    problems.append(f"pd_stream {length}: loaded {dec.get('loaded_tokens')} of "
                                    f"{dec.get('promised_tokens')} promised tokens")
    return {"config": cfg, "ttft_s": ttft, "ratio_pd_vs_alone": ratio, "phases_s": phases,
            "ratio_turn2_vs_cold_pd": turn2_ratio, "turn2_prefiller_loaded_tokens": turn2_loaded,
            "target_ratio": TARGET_RATIO, "records": records, "problems": problems,
            **({"streaming_ratios": stream_ratio, "stream_target_ratio": STREAM_TARGET_RATIO}
               if "pd_stream" in kinds else {})}


def _run_store(store: str, cfg: dict[str, Any], log_dir: Path,
               base: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Start the store's stack, warm up, measure (the comparison's records, then the request kinds');
    always stop it and remove its pool."""
    from lw_bench.pd import compare
    from lw_bench.pd.compare_stack import start_compare_stack

    pool = os.path.join(base, f"lw-bench-pd-{uuid.uuid4().hex[:8]}")
    print(f"lw-bench pd: store {store}: starting prefiller, two decoders and the proxies (logs in {log_dir / store}) ...",
          file=sys.stderr)
    cpus = os.sched_getaffinity(0)  # pinning moves this process to the decoders' CPU: restored after
    try:
        stack = start_compare_stack(store, log_dir / store, pool, block_size=cfg["block_size"],
                                    max_model_len=cfg["max_model_len"], bytes_per_s=cfg["throttle_bytes_per_s"],
                                    relay=cfg["relay"], pin=cfg.get("pin", False),
                                    continue_streams=cfg.get("continue_streams", False))
        try:
            compare.measure(stack, {**cfg, "lengths": [min(cfg["lengths"])], "reps": 1}, seed=10_000)  # one-time costs
            records = compare.measure(stack, cfg, progress=lambda r: print(
                f"  {r['store']:9s} {r['kind']:9s} {r['length']:5d}: TTFT {r['ttft_s'] * 1e3:7.1f} ms", file=sys.stderr))
            by_kind: list[dict[str, Any]] = []
            if cfg["request_kinds"]:
                decode = _text_of_ids()
                request_kinds.measure(stack, {**cfg, "lengths": [min(cfg["lengths"])], "reps": 1}, decode, seed=20_000)
                by_kind = request_kinds.measure(stack, cfg, decode, progress=lambda r: print(
                    f"  {r['store']:9s} {r['request_kind']:19s} {r['target']:5s} {r['length']:5d}: "
                    f"{'TTFT' if request_kinds.REQUEST_KINDS[r['request_kind']].stream else 'answer'} "
                    f"{r['ttft_s'] * 1e3:7.1f} ms", file=sys.stderr))
            return records, by_kind
        finally:
            stack.stop()
    finally:
        os.sched_setaffinity(0, cpus)
        shutil.rmtree(pool, ignore_errors=True)


def _text_of_ids() -> Any:
    """Chat prompts are text: ``ids`` decoded with the try-out model's tokenizer, cut until the text
    encodes to at most ``len(ids)`` tokens (decoded random ids encode to more, BPE merging across
    their boundaries differently)."""
    from tokenizers import Tokenizer

    from lw_bench import models

    tok = Tokenizer.from_file(str(models.gqa_model() / "tokenizer.json"))

    def text(ids: list[int]) -> str:
        enc = tok.encode(tok.decode(ids), add_special_tokens=False).ids
        keep = len(ids)
        out = tok.decode(enc[:keep])
        for _ in range(8):
            over = len(tok.encode(out, add_special_tokens=False).ids) - len(ids)
            if over <= 0:
                break
            keep -= over
            out = tok.decode(enc[:keep])
        return out

    return text


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lw_bench.pd import compare, compare_report
    from lw_bench.pd.result import checked

    cfg = config(args)
    if args.plot or args.out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("lw-bench pd --plot/--out needs matplotlib: pip install 'lw-bench[plot]' (or pip install matplotlib)") from None
    t0 = time.perf_counter()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lw-bench-pd-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(log_dir)
    records: list[dict[str, Any]] = []
    kind_records: list[dict[str, Any]] = []
    try:
        for store in cfg["stores"]:
            got, by_kind = _run_store(store, cfg, log_dir, base)
            records += got
            kind_records += by_kind
    finally:
        if args.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    result = compare.summarize(cfg, records)
    if kind_records:
        result["request_kinds"], problems = request_kinds.summarize(kind_records)
        result["request_kind_records"] = kind_records
        result["problems"] += problems
    result["runtime_s"] = round(time.perf_counter() - t0, 1)
    result["loadavg"] = round(os.getloadavg()[0], 2)
    result["cpus"] = len(os.sched_getaffinity(0))
    checked(result)  # before the figures: a report that breaks its own shape fails first
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        compare_report.plot_ttft(result, str(out / "ttft.png"))
        compare_report.plot_timeline(result, str(out / "timeline.png"))
        result["files"] = {"json": str(out / "result.json"), "ttft": str(out / "ttft.png"),
                           "timeline": str(out / "timeline.png")}
        with open(out / "result.json", "w") as f:
            json.dump(msgspec.to_builtins(checked(result)), f, indent=1, sort_keys=True)
    if args.plot:
        compare_report.plot_ttft(result, args.plot)
        result["plot"] = args.plot
    result = msgspec.to_builtins(checked(result))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    if not getattr(args, "json", False):
        compare_report.print_table(result)
    return result
