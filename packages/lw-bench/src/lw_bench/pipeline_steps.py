"""The step loop both pipeline benches time (``lw-bench pipeline``: host ``measure``, device
``measure_device``): one step is ``start_load``, then per layer ``wait_layer`` and the compute
(layerwise) or every layer's compute after the loads (bulk), then ``finish_load``; every step's
bytes are verified. ``run_scenarios`` runs the scenarios (compute only, transfer only, bulk,
layerwise at each prefetch depth, and the machine's raw copy alone and beside the compute) the
same way for both; the benches bring their KV cache, compute kernel and clock."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from lw_bench import pipeline_result


class StepLoop:
    """Times steps and keeps what they reported: failed blocks, errors, wait times, verification."""

    def __init__(self, loads: list[Any], layers: int, *, sync: Callable[[], None], reset: Callable[[], None],
                 verify: Callable[[], bool]):
        self.loads, self.layers = loads, layers
        self.sync, self.reset, self.verify = sync, reset, verify
        self.failures: list[int] = []
        self.errors: list[str] = []
        self.verified = True
        self.waits: dict[str, list[float]] = {}

    def step(self, pipe: Any, compute: Any, tag: str) -> float:
        self.reset()  # a run that loads nothing would leave the marker
        self.sync()
        t0 = time.perf_counter()
        pipe.start_load(self.loads)
        if pipe.layerwise:
            for layer in range(self.layers):
                pipe.wait_layer(layer)
                compute()
        elif compute is not None:
            for _ in range(self.layers):
                compute()
        res = pipe.finish_load()
        self.sync()
        dt = time.perf_counter() - t0
        self.failures.append(len(res.failed_block_ids))
        self.errors.extend(e for e in res.errors if e not in self.errors)
        self.waits.setdefault(tag, []).append(sum(res.layer_wait_s))
        if not self.verify():
            self.verified = False
        return dt


def run_scenarios(loop: StepLoop, fresh: Callable[..., Any], calibrate: Callable[[float], tuple[int, Any]], cfg: dict[str, Any],
                  *, compute_all: Callable[[Any], float], raw_copy: Callable[[], float],
                  raw_overlap: Callable[[Any], float]) -> tuple[dict[str, list[float]], int, float]:
    """Every scenario ``cfg["reps"]`` times (samples in seconds), with the compute calibrated to
    ``cfg["compute_ms"]`` per layer or else to the measured per-layer transfer time. ``fresh(**kw)``
    builds a pipeline; ``compute_all(kernel)``, ``raw_copy()`` and ``raw_overlap(kernel)`` time
    themselves. Returns (samples, matmul size, compute target in s)."""
    from tqdm import tqdm

    layers, reps, depths = cfg["layers"], cfg["reps"], cfg["depths"]
    bulk_pipe = fresh(layerwise=False)
    lw_pipes: dict[int, Any] = {}
    try:
        loop.step(bulk_pipe, None, "warmup")
        t_layer = statistics.median([loop.step(bulk_pipe, None, "warmup") for _ in range(3)]) / layers
        target = cfg["compute_ms"] / 1e3 if cfg["compute_ms"] else t_layer
        n, kernel = calibrate(target)
        lw_pipes = {d: fresh(prefetch_depth=d) for d in depths}
        samples: dict[str, list[float]] = {
            k: [] for k in ["compute", "transfer", "bulk", *(f"layerwise_{d}" for d in depths), "raw_copy", "raw_overlap"]
        }
        for p in lw_pipes.values():
            loop.step(p, kernel, "warmup")
        with tqdm(total=reps * len(samples), desc="lw-bench pipeline", file=sys.stderr, unit="run") as bar:
            for _ in range(reps):
                samples["compute"].append(compute_all(kernel))
                bar.update()
                samples["transfer"].append(loop.step(bulk_pipe, None, "transfer"))
                bar.update()
                samples["bulk"].append(loop.step(bulk_pipe, kernel, "bulk"))
                bar.update()
                for d, p in lw_pipes.items():
                    samples[f"layerwise_{d}"].append(loop.step(p, kernel, str(d)))
                    bar.update()
                samples["raw_copy"].append(raw_copy())
                bar.update()
                samples["raw_overlap"].append(raw_overlap(kernel))
                bar.update()
        return samples, n, target
    finally:
        bulk_pipe.close()
        for p in lw_pipes.values():
            p.close()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(config: dict[str, Any], samples: dict[str, list[float]], waits: dict[str, list[float]],
              failures: list[int], errors: list[str], verified: bool, **extra: Any) -> pipeline_result.PipelineBenchResult:
    """The report of one pipeline bench run (host or device): medians, hidden fractions, rates;
    ``extra`` adds mode-specific figures (e.g. the device bench's save time)."""
    layers, total, depths = config["layers"], config["total_bytes"], config["depths"]
    med = {k: median(v) for k, v in samples.items()}
    t_c, t_t, t_b = med["compute"], med["transfer"], med["bulk"]
    t_lw = {str(d): med[f"layerwise_{d}"] for d in depths}
    return pipeline_result.PipelineBenchResult(
        config=pipeline_result.PipelineBenchConfig(**config),
        t_compute_s=t_c,
        t_transfer_s=t_t,
        t_bulk_s=t_b,
        t_layerwise_s=t_lw,
        hidden_fraction={d: (t_b - t) / min(t_c, t_t) for d, t in t_lw.items()},
        t_raw_copy_s=med["raw_copy"],
        t_raw_overlap_s=med["raw_overlap"],
        raw_hidden_fraction=(t_c + med["raw_copy"] - med["raw_overlap"]) / min(t_c, med["raw_copy"]),
        per_layer_compute_ms=t_c / layers * 1e3,
        per_layer_transfer_ms=t_t / layers * 1e3,
        transfer_gbps=total / t_t / 1e9,
        **extra,
        layer_wait_ms={str(d): median(waits[str(d)]) * 1e3 for d in depths},
        samples=samples,
        load_failures=sum(failures),
        errors=errors[:20],
        verified=verified,
    )
