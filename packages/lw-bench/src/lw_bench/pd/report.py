"""``lw-bench pd``'s table and plot (see lw_bench.pd.mode for what the phases mean)."""

from __future__ import annotations

from typing import Any

# In the order they happen on a PD request's critical path.
PHASES = ("proxy_dispatch", "decoder_sched", "metaserver_wait", "prefill", "answer_relay", "decoder_resched",
          "load", "decoder_compute", "first_byte_relay")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def print_table(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"lw-bench pd: block {c['block_size']}, {c['reps']} reps per length, PD streams {c['pd_max_tokens']} tokens")
    print("\nper request (ms): " + " | ".join(PHASES))
    for rec in r["records"]:
        ph = rec["phases"]
        if rec["kind"] in ("pd", "pd_stream"):
            dec = rec["decoder"]
            parts = " ".join(_ms(ph.get(k)) for k in PHASES)
            print(f"  {rec['kind']:12s} {rec['length']:5d} TTFT {_ms(rec['ttft_s']):>7}: {parts}  "
                  f"(loaded {dec.get('loaded_tokens')}/{dec.get('prompt_tokens')}, {dec.get('remote_prefill')})")
        elif rec["kind"] == "turn2":
            print(f"  turn2        {rec['length']:5d} TTFT {_ms(rec['ttft_s']):>7}: prefiller loaded "
                  f"{rec.get('prefiller_loaded_tokens')} tokens, decoder loaded {rec['decoder'].get('loaded_tokens')}")
        else:
            print(f"  {rec['kind']:12s} {rec['length']:5d} TTFT {_ms(rec['ttft_s']):>7}: dispatch {_ms(ph.get('dispatch'))} "
                  f"prefill {_ms(ph.get('prefill'))} relay {_ms(ph.get('first_byte_relay'))}")
    print("\n| length | PD TTFT ms | prefiller TTFT ms | PD / prefiller (median of pairs) | target |")
    print("|---|---|---|---|---|")
    for L, ratio in r["ratio_pd_vs_alone"].items():
        ok = "met" if ratio is not None and ratio <= r["target_ratio"] else "NOT met"
        print(f"| {L} | {_ms(r['ttft_s']['pd'][L])} | {_ms(r['ttft_s']['alone'][L])} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} | <= {r['target_ratio']:.2f} ({ok}) |")
    sr = r.get("streaming_ratios")
    if sr:
        print("\n| length | streaming PD TTFT ms | its prefiller TTFT ms | streaming PD / prefiller | "
              "streaming / non-streaming PD | target |")
        print("|---|---|---|---|---|---|")
        for L, ratio in sr["pd_stream_vs_alone_stream"].items():
            ok = "met" if ratio is not None and ratio <= r["stream_target_ratio"] else "NOT met"
            vs = sr["pd_stream_vs_pd"].get(L)
            print(f"| {L} | {_ms(r['ttft_s']['pd_stream'][L])} | {_ms(r['ttft_s']['alone_stream'][L])} | "
                  f"{'-' if ratio is None else f'{ratio:.2f}'} | {'-' if vs is None else f'{vs:.2f}'} | "
                  f"<= {r['stream_target_ratio']:.2f} ({ok}) |")
    print("\nsecond turn (prefiller loads turn 1) vs a cold prompt, both through the proxy: " + ", ".join(
        f"{L}: {_ms(r['ttft_s']['turn2'][L])} ms vs {_ms(r['ttft_s']['pd'][L])} ms "
        f"(median ratio {r['ratio_turn2_vs_cold_pd'][L]}, prefiller loaded {r['turn2_prefiller_loaded_tokens'][L]})"
        for L in r["ratio_turn2_vs_cold_pd"]))
    print("\nPD breakdown, median ms: " + ", ".join(
        f"{L}: " + " ".join(f"{k}={_ms(v)}" for k, v in ph.items()) for L, ph in r["phases_s"].items()))
    for p in r["problems"]:
        print(f"PROBLEM: {p}")


def plot(r: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(r["phases_s"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(lengths))
    a1.bar([i - 0.2 for i in x], [(r["ttft_s"]["alone"][L] or 0) * 1e3 for L in lengths], 0.4, label="prefiller alone")
    a1.bar([i + 0.2 for i in x], [(r["ttft_s"]["pd"][L] or 0) * 1e3 for L in lengths], 0.4, label="PD via lw-proxy")
    for i, L in enumerate(lengths):
        ratio = r["ratio_pd_vs_alone"][L]
        if ratio is not None:
            a1.annotate(f"{ratio:.2f}x", (i + 0.2, (r["ttft_s"]["pd"][L] or 0) * 1e3), ha="center", va="bottom")
    a1.set_xticks(list(x), lengths)
    a1.set_xlabel("prompt tokens")
    a1.set_ylabel("TTFT, ms (median)")
    a1.legend(fontsize=8)
    bottom = [0.0] * len(lengths)
    cmap = plt.get_cmap("tab10")
    for j, ph in enumerate(PHASES):
        vals = [max(0.0, (r["phases_s"][L].get(ph) or 0.0)) * 1e3 for L in lengths]
        a2.bar(list(x), vals, 0.5, bottom=bottom, label=ph, color=cmap(j))
        bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_xticks(list(x), lengths)
    a2.set_xlabel("prompt tokens")
    a2.set_ylabel("ms (median per phase)")
    a2.set_title("where a PD request's TTFT goes", fontsize=10)
    a2.legend(fontsize=7)
    fig.suptitle(f"lw-bench pd: block {r['config']['block_size']}, {r['config']['reps']} reps", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
