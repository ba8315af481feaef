"""Text tables of the device bench's ``rates``, ``model_shaped`` and ``host_work`` figures (``lw-bench pipeline``
prints them; scripts/device-check.sh prints them in its summary)."""

from __future__ import annotations

from typing import Any


def rate_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per case and mechanism: pool GB/s and its share of the pinned-DMA ceiling, loads and saves."""
    if not rows:
        return []
    out = [f"  {'case':>8} {'mechanism':>9} {'load GB/s':>9} {'of DMA':>6} {'save GB/s':>9} {'of DMA':>6} "
           f"{'DMA up/down':>11}  moved by"]
    for r in rows:
        used = ",".join(f"{k}={v}" for k, v in r["used"].items() if v) or "-"
        out.append(f"  {r['case']:>8} {r['mechanism']:>9} {r['load_gbps']:9.2f} {r['load_of_ceiling']:6.2f} "
                   f"{r['save_gbps']:9.2f} {r['save_of_ceiling']:6.2f} {r['ceiling_load_gbps']:5.1f}/{r['ceiling_save_gbps']:<5.1f}"
                   f"  {used}{'' if r['verified'] else '  NOT VERIFIED'}{'  ' + r['error'] if r.get('error') else ''}")
    return out


def model_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per shape and prefix length: prefill time, and load / prefill per mechanism beside PCIe / prefill."""
    if not rows:
        return []
    mechs = list(rows[0]["load_over_prefill"])
    out = [f"  {'shape':>10} {'tokens':>6} {'prefill ms':>10} {'KV MiB':>7} {'PCIe/prefill':>12} "
           + " ".join(f"{m + '/prefill':>17}" for m in mechs)]
    for r in rows:
        out.append(f"  {r['shape']:>10} {r['tokens']:6d} {r['prefill_s'] * 1e3:10.1f} {r['kv_bytes'] / 2**20:7.0f} "
                   f"{r['pcie_over_prefill']:12.3f} " + " ".join(f"{r['load_over_prefill'][m]:17.3f}" for m in mechs))
    return out


def host_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per case and mechanism: the host's ns per window and the GB/s that alone allows, loads and saves."""
    if not rows:
        return []
    out = [f"  {'case':>8} {'mechanism':>9} {'windows':>7} {'load ns/win':>11} {'bound GB/s':>10} "
           f"{'save ns/win':>11} {'bound GB/s':>10}"]
    for r in rows:
        out.append(f"  {r['case']:>8} {r['mechanism']:>9} {r['windows']:7d} {r['load_ns_per_window']:11.0f} "
                   f"{r['load_bound_gbps']:10.1f} {r['save_ns_per_window']:11.0f} {r['save_bound_gbps']:10.1f}")
    return out
