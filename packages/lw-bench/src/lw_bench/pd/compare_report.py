"""``lw-bench pd``'s tables and figures for the comparison (lw_bench.pd.compare)."""

from __future__ import annotations

from typing import Any

from lw_bench.pd.report import PHASES

LABELS = {"alone": "prefiller alone", "pd": "PD", "pd_stream": "streaming PD", "pd_relay": "PD, prefill-first",
          "pd_stream_relay": "streaming PD, prefill-first"}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def store_label(r: dict[str, Any], store: str) -> str:
    if store == "throttled":
        return f"throttled ({r['config']['throttle_bytes_per_s'] / 1e6:g} MB/s link per engine)"
    if store == "memcache":
        return "memcache (host_shm, one host)"
    return "embedded"


def print_table(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"lw-bench pd: block {c['block_size']}, {c['reps']} reps, PD streams {c['pd_max_tokens']} tokens; "
          f"load average {r.get('loadavg', '-')}"
          + ("; prefill-first proxies with --continue-streams" if c.get("continue_streams") else ""))
    print("\nper request (ms): TTFT, then " + " | ".join(PHASES))
    for rec in r["records"]:
        ph = rec["phases"]
        head = f"  {rec['store']:9s} {rec['kind']:9s} {rec['length']:5d} TTFT {_ms(rec['ttft_s']):>7}"
        if "relayed" in rec:
            head += " (relayed)" if rec["relayed"] else " (not relayed)"
        if rec["kind"] == "alone":
            print(f"{head}: prefill {_ms(ph.get('prefill'))}")
            continue
        if rec["kind"] == "turn2":
            print(f"{head}: prefiller loaded {rec.get('prefiller_loaded_tokens')} tokens of turn 1")
            continue
        dec = rec["decoder"]
        print(f"{head}: " + " ".join(_ms(ph.get(k)) for k in PHASES)
              + f"  (loaded {dec.get('loaded_tokens')}/{dec.get('prompt_tokens')}, {dec.get('remote_prefill')})")
    t = r["targets"]
    print(f"\n| store | length | alone ms | PD ms | streaming PD ms | prefill-first PD ms | streaming prefill-first PD ms | "
          f"PD / alone (<= {t['pd_vs_alone']}) | streaming / alone (<= {t['pd_stream_vs_alone']}) | prefill-first / alone | "
          "streaming prefill-first / alone | streaming / PD | decoder ready after prefiller's last layer, ms (streaming) | "
          "one layer's transfer, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for store in r["stores"]:
        for L, tt in r["ttft_s"][store].items():
            ra = r["ratios"][store][L]
            hid = r["transfer_hidden"][store][L].get("pd_stream", {})
            print(f"| {store_label(r, store)} | {L} | {_ms(tt.get('alone'))} | {_ms(tt.get('pd'))} | "
                  f"{_ms(tt.get('pd_stream'))} | {_ms(tt.get('pd_relay'))} | {_ms(tt.get('pd_stream_relay'))} | "
                  f"{_x(ra.get('pd_vs_alone'))} | {_x(ra.get('pd_stream_vs_alone'))} | {_x(ra.get('pd_relay_vs_alone'))} | "
                  f"{_x(ra.get('pd_stream_relay_vs_alone'))} | "
                  f"{_x(ra.get('pd_stream_vs_pd'))} | {hid.get('ready_after_last_layer_ms', '-')} | "
                  f"{hid.get('layer_transfer_ms', '-')} |")
    print("\nprefill-first rows, requests whose first token the proxy relayed from the prefiller (the others "
          "took the decoder's path: the prefiller's first token was not relayable, or the decoder answered first): "
          + "; ".join(f"{store} {L}: " + ", ".join(
              f"{k} {ra.get(k + '_relayed_share', 0):.0%} relayed, {_x(ra.get(k + '_relayed_vs_alone'))} x alone"
              for k in ("pd_relay", "pd_stream_relay") if k + "_relayed_share" in ra)
              for store in r["stores"] for L, ra in r["ratios"][store].items()))
    print("\nfrom the prefiller's end of the request to the client's first token, median ms (what PD adds "
          "after the prefill; alone: the prefiller's own output path):")
    for store in r["stores"]:
        for L, by_kind in r["after_prefill_s"][store].items():
            print(f"  {store} {L}: " + ", ".join(f"{k} {_ms(v)}" for k, v in by_kind.items()))
    print("\nsecond turn (the prefiller loads turn 1, half the prompt) vs a cold PD prompt: " + "; ".join(
        f"{store} {L}: {_ms(tt.get('turn2'))} vs {_ms(tt.get('pd'))} ms (median ratio {_x(r['ratios'][store][L].get('turn2_vs_pd'))}, "
        f"prefiller loaded {r['turn2_prefiller_loaded_tokens'].get(store, {}).get(L)})"
        for store in r["stores"] for L, tt in r["ttft_s"][store].items()))
    for store in r["stores"]:
        for L, by_kind in r["phases_s"][store].items():
            ph = by_kind.get("pd", {})
            print(f"PD breakdown, median ms ({store}, {L}): " + " ".join(f"{k}={_ms(v)}" for k, v in ph.items()))
    if r.get("request_kinds"):
        print_request_kinds(r)
    for p in r["problems"]:
        print(f"PROBLEM: {p}")


def print_request_kinds(r: dict[str, Any]) -> None:
    """Per request kind (lw_bench.pd.request_kinds): the prefiller alone, PD through the default
    proxy, their ratio and the share of first tokens relayed from the prefill."""
    from lw_bench.pd.request_kinds import REQUEST_KINDS

    print("\nper request kind, through the default proxy (streamed: TTFT; not streamed: the whole answer):")
    print("\n| store | length | request kind | streamed | alone ms | PD ms | PD / alone | first token relayed "
          "| not relayed: why | PD gaps after the first token, ms: first / next |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for store, by_len in r["request_kinds"].items():
        for L, by_kind in by_len.items():
            for name, f in by_kind.items():
                share = "-" if f["relayed_share"] is None else f"{f['relayed_share']:.0%}"
                why = ", ".join(f"{k} {n}" for k, n in (f.get("not_relayed") or {}).items()) or "-"
                gaps = ("-" if f.get("first_gap_s") is None else
                        f"{_ms(f['first_gap_s'])} / {_ms(f.get('next_gap_s'))}")
                print(f"| {store} | {L} | {name} | {'yes' if REQUEST_KINDS[name].stream else 'no'} | "
                      f"{_ms(f['alone_s'])} | {_ms(f['pd_s'])} | {_x(f['pd_vs_alone'])} | {share} | {why} | {gaps} |")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft(r: dict[str, Any], out: str) -> None:
    plt = _plt()
    stores = r["stores"]
    fig, axes = plt.subplots(1, len(stores), figsize=(5.5 * len(stores), 4.2), squeeze=False)
    kinds = ["alone", "pd", "pd_stream", "pd_relay", "pd_stream_relay"]
    for ax, store in zip(axes[0], stores):
        lengths = list(r["ttft_s"][store])
        present = [k for k in kinds if any(r["ttft_s"][store][L].get(k) for L in lengths)]
        w = 0.8 / max(1, len(present))
        for j, k in enumerate(present):
            xs = [i - 0.4 + w * (j + 0.5) for i in range(len(lengths))]
            ax.bar(xs, [(r["ttft_s"][store][L].get(k) or 0) * 1e3 for L in lengths], w, label=LABELS[k])
        ax.set_xticks(range(len(lengths)), lengths)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT, ms (median)")
        ax.set_title(store_label(r, store), fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"lw-bench pd: TTFT, block {r['config']['block_size']}, {r['config']['reps']} reps", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def plot_timeline(r: dict[str, Any], out: str) -> None:
    """Per store (rows) and length (columns): the last rep's PD and streaming PD requests, layer
    index against ms after the client's send: prefiller layer saved/published, decoder layer landed,
    and the TTFT."""
    plt = _plt()
    stores, lengths = r["stores"], r["config"]["lengths"]
    fig, axes = plt.subplots(len(stores), len(lengths), figsize=(4.2 * len(lengths), 3.3 * len(stores)),
                             squeeze=False)
    style = {"pd": ("tab:blue", "PD"), "pd_stream": ("tab:orange", "streaming PD")}
    for i, store in enumerate(stores):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            for kind, (color, label) in style.items():
                recs = [x for x in r["records"] if x["store"] == store and x["length"] == length
                        and x["kind"] == kind and x["status"] == 200 and x.get("timeline", {}).get("layers")]
                if not recs:
                    continue
                tl = recs[-1]["timeline"]
                ys = [x["layer"] for x in tl["layers"]]
                src = "prefill_published" if kind == "pd_stream" else "prefill_saved"
                ax.plot([_nan(x[src]) for x in tl["layers"]], ys, "o--", color=color, ms=4,
                        label=f"{label}: prefiller layer {'published' if kind == 'pd_stream' else 'saved'}")
                ax.plot([_nan(x["decoder_landed"]) for x in tl["layers"]], ys, "s-", color=color, ms=4,
                        label=f"{label}: decoder layer landed")
                ax.axvline(tl["ttft_ms"], color=color, lw=0.8, ls=":")
            ax.set_title(f"{store}, {length} tokens", fontsize=9)
            ax.set_xlabel("ms after the client's send (dotted: TTFT)", fontsize=8)
            ax.set_ylabel("layer")
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
