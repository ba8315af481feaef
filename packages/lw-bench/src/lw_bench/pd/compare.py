"""``lw-bench pd``'s comparison: per store, the prefiller alone, non-streaming PD, streaming PD and
(with ``--prefill-first`` in the proxy) prefill-first PD, alternated on fresh prompts, with the
per-request breakdown and a per-layer timeline (lw_bench.pd.compare_stack, lw_bench.pd.throttle).

Kinds: ``alone`` (``max_tokens: 1`` straight to the prefiller), ``pd`` (non-streaming decoder),
``pd_stream`` (streaming decoder), ``pd_relay`` (non-streaming decoder behind a proxy with
``--prefill-first``), ``pd_stream_relay`` (streaming decoder behind a proxy with
``--prefill-first``: what a streaming deployment gets from lw-proxy's default). Each (store, rep, length, kind) has its own prompt, the same in every store.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from lw_bench.pd.report import PHASES
from lw_bench.pd.request import PD_MAX_TOKENS, VOCAB_HI, VOCAB_LO, _records, breakdown, stream_ttft
from lw_bench.pd.stack import metric_sum

PD_KINDS = ("pd", "pd_stream", "pd_relay", "pd_stream_relay")
RELAY_KINDS = ("pd_relay", "pd_stream_relay")
RELAYED = "lw_proxy_prefill_first_relayed_total"
DECODER_OF = {"pd": "decode", "pd_relay": "decode", "pd_stream": "decode_stream", "pd_stream_relay": "decode_stream"}
STREAMING_KINDS = ("pd_stream", "pd_stream_relay")
NUM_LAYERS = 4  # the try-out GQA model (lw_bench.models.GQA_SPEC)


def prompt(seed: int, rep: int, length: int, kind: str) -> list[int]:
    rng = random.Random(f"{seed}/{rep}/{length}/{kind}")
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)]


def measure(stack: Any, cfg: dict[str, Any], *, seed: int = 0, progress: Any = None) -> list[dict[str, Any]]:
    kinds = ["alone", *(k for k in PD_KINDS if k in stack.proxies)]
    out: list[dict[str, Any]] = []
    for rep in range(cfg["reps"]):
        for length in cfg["lengths"]:
            k = (rep + length // 16) % len(kinds)
            for kind in kinds[k:] + kinds[:k]:
                body = {"model": "tiny", "prompt": prompt(seed, rep, length, kind), "temperature": 0.0,
                        "ignore_eos": True, "max_tokens": 1 if kind == "alone" else cfg["pd_max_tokens"]}
                stack.mark()
                url = stack.servers["prefill"].url if kind == "alone" else stack.proxies[kind].url
                relayed0 = metric_sum(url, RELAYED) if kind in RELAY_KINDS else 0.0
                t_send, t_first, status = stream_ttft(url, body)
                rec: dict[str, Any] = {"store": stack.store, "kind": kind, "length": length, "rep": rep,
                                       "status": status, "ttft_s": round(t_first - t_send, 4)}
                if kind in RELAY_KINDS:  # the first token came from the prefiller (else from the decoder)
                    rec["relayed"] = metric_sum(url, RELAYED) > relayed0
                precs = _records(stack.servers["prefill"], 1)
                p = precs[0] if precs else None
                rec["after_prefill_s"] = after_prefill(p, t_send, t_first)
                if kind == "alone":
                    pt = (p or {}).get("t", {})
                    rec["phases"] = {"prefill": round(pt["step_done"] - pt["arrival"], 4)
                                     if pt.get("step_done") and pt.get("arrival") else None}
                else:
                    drecs = _records(stack.servers[DECODER_OF[kind]], 1)
                    d = drecs[0] if drecs else {}
                    rec["phases"] = breakdown(t_send, t_first, d, p)
                    rec["decoder"] = {x: d.get(x) for x in ("prompt_tokens", "promised_tokens", "loaded_tokens",
                                                            "remote_prefill")}
                    rec["timeline"] = timeline(stack.new_events("prefill"), stack.new_events(DECODER_OF[kind]),
                                               t_send, t_first)
                out.append(rec)
                if progress is not None:
                    progress(rec)
            out.append(second_turn(stack, cfg, seed, rep, length))
            if progress is not None:
                progress(out[-1])
    return out


def after_prefill(p: dict[str, Any] | None, t_send: float, t_first: float) -> float | None:
    """Seconds from the prefiller's end of the request (its last step: ``finished``, which also
    covers a prompt prefilled in several steps) to the client's first token: what PD adds after the
    prefill. Far less noisy than TTFT ratios on a loaded host, where the prefill itself varies most."""
    t = (p or {}).get("t", {})
    end = t.get("finished") or t.get("step_done")
    return round(t_first - end, 4) if end else None


def second_turn(stack: Any, cfg: dict[str, Any], seed: int, rep: int, length: int) -> dict[str, Any]:
    """A conversation's second turn through the non-streaming proxy: turn 1 (the first half) first,
    then turn 1 + as many new tokens; the prefiller loads turn 1's chunks (producer_is_to_load) and
    computes the rest. Compared with the cold ``pd`` prompt of the same length."""
    full = prompt(seed, rep, length, "turn2")
    body = {"model": "tiny", "temperature": 0.0, "ignore_eos": True, "max_tokens": cfg["pd_max_tokens"]}
    stack.mark()
    stream_ttft(stack.proxies["pd"].url, {**body, "prompt": full[: length // 2]})
    _records(stack.servers["prefill"], 1)  # turn 1's prefill record is not read as turn 2's
    _records(stack.servers["decode"], 1)
    stack.mark()
    t_send, t_first, status = stream_ttft(stack.proxies["pd"].url, {**body, "prompt": full})
    precs = _records(stack.servers["prefill"], 1)
    drecs = _records(stack.servers["decode"], 1)
    d = drecs[0] if drecs else {}
    return {"store": stack.store, "kind": "turn2", "length": length, "rep": rep, "status": status,
            "ttft_s": round(t_first - t_send, 4), "phases": breakdown(t_send, t_first, d, precs[0] if precs else None),
            "prefiller_loaded_tokens": precs[0].get("loaded_tokens") if precs else None}


def timeline(pev: list[dict[str, Any]], dev: list[dict[str, Any]], t_send: float, t_first: float,
             num_layers: int = NUM_LAYERS) -> dict[str, Any]:
    """Per layer, ms after the client sent the request: when the prefiller's save of the layer
    ended (last ``write``/``view`` at its offset), when it was published (streaming; in the last
    prefill step, which is what the decoder waits for), and when the
    decoder's copy of it ended (last ``read``/``view``). ``layer_transfer_ms``: the median
    decoder read call (one layer of every chunk of a step)."""
    sizes = [e["nbytes"] for e in pev if e["op"] == "reserve"]
    layers: list[dict[str, Any]] = []
    if not sizes:
        return {"layers": layers, "ttft_ms": round((t_first - t_send) * 1e3, 2)}
    layer_nbytes = max(1, sizes[0] // num_layers)

    def ms(t: float) -> float:
        return round((t - t_send) * 1e3, 2)

    def last(evs: list[dict[str, Any]], ops: tuple[str, ...], layer: int) -> float | None:
        ts = [e["t"] for e in evs if e["op"] in ops and e.get("off", -1) // layer_nbytes == layer]
        return ms(max(ts)) if ts else None

    # A prompt prefilled in several steps (chunked prefill) publishes layers 0.. again for each
    # step's chunks: the decoder is ready only after the LAST step's, so take that step's publishes.
    last_step: list[dict[str, Any]] = []
    for e in sorted((e for e in pev if e["op"] == "publish"), key=lambda e: e["t"]):
        if last_step and e["upto"] <= last_step[-1]["upto"]:
            last_step = []
        last_step.append(e)
    for i in range(num_layers):
        pub = [e["t"] for e in last_step if e["upto"] // layer_nbytes - 1 >= i]
        layers.append({"layer": i, "prefill_saved": last(pev, ("write", "view"), i),
                       "prefill_published": ms(min(pub)) if pub else None,
                       "decoder_landed": last(dev, ("read", "view"), i)})
    reads = [(e["t"] - e["t0"]) * 1e3 for e in dev if e["op"] == "read"]
    return {"layers": layers, "ttft_ms": ms(t_first), "layer_transfer_ms": round(statistics.median(reads), 2)
            if reads else None, "layer_nbytes": layer_nbytes}


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def ready_after_last_layer(tl: dict[str, Any]) -> float | None:
    """ms from the prefiller's last layer (published, else saved) to the decoder's last layer landed."""
    if not tl.get("layers"):
        return None
    last = tl["layers"][-1]
    src = last["prefill_published"] if last["prefill_published"] is not None else last["prefill_saved"]
    if src is None or last["decoder_landed"] is None:
        return None
    return round(last["decoder_landed"] - src, 2)


def summarize(cfg: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per store and length; ratios are medians of per-rep pairs (each PD kind against the
    alone request of its rep, same store), robust to drift over the run."""
    stores = list(dict.fromkeys(r["store"] for r in records))
    ttft: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    phases: dict[str, Any] = {}
    hidden: dict[str, Any] = {}
    turn2_loaded: dict[str, Any] = {}
    after: dict[str, Any] = {}
    problems: list[str] = []
    for store in stores:
        ttft[store], ratios[store], phases[store], hidden[store], after[store] = {}, {}, {}, {}, {}
        for length in cfg["lengths"]:
            L = str(length)
            rs = [r for r in records if r["store"] == store and r["length"] == length]
            problems += [f"{store} {r['kind']} {length}: HTTP {r['status']}" for r in rs if r["status"] != 200]
            ok = [r for r in rs if r["status"] == 200]
            kinds = list(dict.fromkeys(r["kind"] for r in ok))
            ttft[store][L] = {k: _median([r["ttft_s"] for r in ok if r["kind"] == k]) for k in kinds}
            by_rep: dict[int, dict[str, float]] = {}
            for r in ok:
                by_rep.setdefault(r["rep"], {})[r["kind"]] = r["ttft_s"]
            ratios[store][L] = {f"{k}_vs_alone": _median([v[k] / v["alone"] for v in by_rep.values()
                                                         if v.get(k) and v.get("alone")]) for k in PD_KINDS if k in kinds}
            if "pd_stream" in kinds and "pd" in kinds:
                ratios[store][L]["pd_stream_vs_pd"] = _median([v["pd_stream"] / v["pd"] for v in by_rep.values()
                                                               if v.get("pd_stream") and v.get("pd")])
            if "pd_stream_relay" in kinds and "pd_stream" in kinds:
                ratios[store][L]["pd_stream_relay_vs_pd_stream"] = _median(
                    [v["pd_stream_relay"] / v["pd_stream"] for v in by_rep.values() if v.get("pd_stream_relay") and v.get("pd_stream")])
            if "pd_relay" in kinds and "pd" in kinds:
                ratios[store][L]["pd_relay_vs_pd"] = _median([v["pd_relay"] / v["pd"] for v in by_rep.values()
                                                              if v.get("pd_relay") and v.get("pd")])
            for k in RELAY_KINDS:
                if k in kinds:
                    rel = [r for r in ok if r["kind"] == k and r.get("relayed")]
                    ratios[store][L][f"{k}_relayed_share"] = round(len(rel) / len([r for r in ok if r["kind"] == k]), 2)
                    ratios[store][L][f"{k}_relayed_vs_alone"] = _median(
                        [r["ttft_s"] / by_rep[r["rep"]]["alone"] for r in rel if by_rep[r["rep"]].get("alone")])
            after[store][L] = {k: _median([r["after_prefill_s"] for r in ok if r["kind"] == k
                                           and r.get("after_prefill_s") is not None]) for k in kinds}
            phases[store][L] = {k: {ph: _median([r["phases"][ph] for r in ok if r["kind"] == k
                                                 and r["phases"].get(ph) is not None]) for ph in PHASES}
                                for k in PD_KINDS if k in kinds}
            hidden[store][L] = {k: {"ready_after_last_layer_ms": _median([x for r in ok if r["kind"] == k
                                                                          if (x := ready_after_last_layer(r["timeline"])) is not None]),
                                    "layer_transfer_ms": _median([r["timeline"]["layer_transfer_ms"] for r in ok
                                                                  if r["kind"] == k and r["timeline"].get("layer_transfer_ms")])}
                                for k in PD_KINDS if k in kinds}
            if "turn2" in kinds and "pd" in kinds:
                ratios[store][L]["turn2_vs_pd"] = _median([v["turn2"] / v["pd"] for v in by_rep.values()
                                                           if v.get("turn2") and v.get("pd")])
                turn2_loaded.setdefault(store, {})[L] = _median(
                    [r["prefiller_loaded_tokens"] for r in ok if r["kind"] == "turn2" and r.get("prefiller_loaded_tokens") is not None])
            for r in ok:
                dec = r.get("decoder")
                if not dec:
                    continue
                want = ("streaming", "pool holds the prompt") if r["kind"] in STREAMING_KINDS else ("ok", "pool holds the prompt")
                if dec.get("remote_prefill") not in want:
                    problems.append(f"{store} {r['kind']} {length}: remote prefill {dec.get('remote_prefill')!r}")
                elif dec.get("loaded_tokens") != dec.get("promised_tokens"):
                    problems.append(f"{store} {r['kind']} {length}: loaded {dec.get('loaded_tokens')} of "
                                    f"{dec.get('promised_tokens')} promised tokens")
    return {"config": cfg, "stores": stores, "ttft_s": ttft, "ratios": ratios, "phases_s": phases,
            "transfer_hidden": hidden, "after_prefill_s": after,
            "turn2_prefiller_loaded_tokens": turn2_loaded, "records": records, "problems": problems,
            "targets": {"pd_vs_alone": 1.10, "pd_stream_vs_alone": 1.03}}


__all__ = ["PD_MAX_TOKENS", "measure", "summarize", "timeline"]
