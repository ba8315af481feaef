"""``lw-bench pipeline --kv-device DEV --model-shaped SHAPE[,SHAPE]``: what a pool hit costs
against recomputing the prefix, without vLLM.

A dense prefill of a named model shape is timed on the device (bf16 on an accelerator, float32 on
the CPU; torch's SDPA, causal, GQA; one layer's random weights reused for every layer: the
model's arithmetic, one layer's memory), next to the time to load that prefix's KV from the pool
at the rate each mechanism reached in the same run on the model-shaped case (``pipeline_rates``)
and at the pinned-DMA ceiling: ``load / prefill`` against ``PCIe / prefill`` (below 1, a hit
beats recomputing; the ceiling is the physical limit).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from lw_bench.pipeline_result import ModelRow, RateRow

# hidden, heads, kv heads, head dim, intermediate, layers; token counts timed
SHAPES: dict[str, tuple[tuple[int, int, int, int, int, int], list[int]]] = {
    "llama3-8b": ((4096, 32, 8, 128, 14336, 32), [1024, 8192]),
    "llama3-70b": ((8192, 64, 8, 128, 28672, 80), [2048]),
    "tiny": ((256, 4, 2, 64, 512, 2), [128, 256]),  # a smoke test of the code on any machine
}


def _prefill_s(acc: Any, shape: tuple[int, int, int, int, int, int], tokens: int, reps: int) -> tuple[float, int]:
    torch = acc.torch
    import torch.nn.functional as F

    h, nh, nkv, hd, inter, layers = shape
    dev = acc.device
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*s: int) -> Any:
        return torch.randn(*s, device=dev, dtype=dtype, generator=g) * 0.02

    wqkv, wo, wgu, wd = w(h, (nh + 2 * nkv) * hd), w(nh * hd, h), w(h, 2 * inter), w(inter, h)
    x0 = torch.randn(tokens, h, device=dev, dtype=dtype, generator=g)

    def fwd() -> None:
        x = x0
        for _ in range(layers):
            q, k, v = (x @ wqkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(1, tokens, nh, hd).transpose(1, 2)
            k = k.view(1, tokens, nkv, hd).transpose(1, 2)
            v = v.view(1, tokens, nkv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(tokens, nh * hd) @ wo
            gt, up = (x @ wgu).chunk(2, dim=-1)
            x = x + (F.silu(gt) * up) @ wd

    fwd()
    ts = []
    for _ in range(reps):
        acc.sync()
        t0 = time.perf_counter()
        fwd()
        acc.sync()
        ts.append(time.perf_counter() - t0)
    kv_bytes = tokens * layers * 2 * nkv * hd * (2 if dtype == torch.bfloat16 else 4)
    return statistics.median(ts), kv_bytes


def measure_model(acc: Any, cfg: dict[str, Any], rates: list[RateRow] | None) -> list[ModelRow]:
    """Prefill times of ``cfg["model_shaped"]``'s shapes, beside the loads of their prefixes at the
    model-shaped case's rates (measured here when ``--rates`` did not)."""
    if not rates or not any(r.case == "model" for r in rates):
        from lw_bench.pipeline_rates import measure_rates

        rates = measure_rates(acc, cfg, only=["model"])
    model = [r for r in rates if r.case == "model" and r.load_gbps > 0]
    if not model:
        return []  # the model-shaped case could not run here (pipeline_rates said why)
    ceiling = model[0].ceiling_load_gbps
    rows: list[ModelRow] = []
    for name in cfg["model_shaped"]:
        shape, lengths = SHAPES[name]
        for tokens in lengths:
            t, kv_bytes = _prefill_s(acc, shape, tokens, max(2, min(cfg["reps"], 5)))
            load = {r.mechanism: kv_bytes / (r.load_gbps * 1e9) for r in model}
            pcie = kv_bytes / (ceiling * 1e9)
            rows.append(ModelRow(shape=name, tokens=tokens, prefill_s=t, kv_bytes=kv_bytes, pcie_load_s=pcie,
                                 pcie_over_prefill=pcie / t, load_s=load,
                                 load_over_prefill={m: s / t for m, s in load.items()}))
    return rows
