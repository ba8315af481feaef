"""``lw-bench pipeline --kv-device DEV``: the pipeline bench with the KV cache on a torch device.

The same scenarios and figures as the CPU bench (``pipeline_bench``), but the "KV cache" is one
uint8 tensor per layer on the device, copies go through lw_vllm's ``TorchCopier`` device path
(pinned staging, H2D/D2H on side streams ordered by events), and compute is a float32 matmul per
layer on the device's compute stream. Every step ends with a device synchronize, so its time
includes the copies. The ceiling (``raw_*``) is a plain host->device DMA of the same bytes from
pinned memory on a side stream, alone and next to the same compute.

Imports torch and lw_vllm lazily (this module is loaded only in device mode), so lw-core stays
free of both. ``cpu-torch`` runs this code on CPU tensors with inline copies: a smoke test of the
device mode on a machine without a device, with no overlap to show.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

from lw_bench.pipeline import _median, open_backend, summarize
from lw_bench.pipeline_result import PipelineBenchResult

if TYPE_CHECKING:
    from lw_vllm.device.device_streams import InlineOps


class _Accel:
    """The few device calls the bench makes itself (synchronize, a side stream, pinned memory)."""

    def __init__(self, name: str):
        import torch

        self.torch = torch
        self.inline = name == "cpu-torch"
        self.ops: InlineOps | None = None  # TorchCopier's device ops: inline on the CPU, its own on a device
        if self.inline:
            from lw_vllm.device.device_streams import InlineOps

            self.device, self.ops = torch.device("cpu"), InlineOps()
            return
        from lw_vllm.device.device_streams import import_device_runtime

        dev = torch.device(name)
        import_device_runtime(dev)
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if acc is None or acc.type != dev.type:
            raise SystemExit(f"lw-bench pipeline: --kv-device={name}: no {dev.type} device on this machine (found {acc})")
        if dev.index is None:
            dev = torch.device(dev.type, torch.accelerator.current_device_index())
        torch.accelerator.set_device_index(dev.index)
        self.device, self.ops = dev, None

    def sync(self) -> None:
        if not self.inline:
            self.torch.accelerator.synchronize()

    def side(self) -> Any:
        return contextlib.nullcontext() if self.inline else self.torch.Stream(device=self.device)

    def pinned(self, nbytes: int) -> Any:
        t = self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=not self.inline)
        return t


def _calibrate(acc: _Accel, target_s: float) -> tuple[int, Any]:
    torch = acc.torch

    def kernel_for(n: int) -> Any:
        g = torch.Generator(device=acc.device).manual_seed(0)
        a = torch.randn(n, n, device=acc.device, generator=g)
        b = torch.randn(n, n, device=acc.device, generator=g)
        c = torch.empty(n, n, device=acc.device)
        return lambda: torch.mm(a, b, out=c)

    def timed(k: Any) -> float:
        k()
        acc.sync()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            k()
            acc.sync()
            ts.append(time.perf_counter() - t0)
        return _median(ts)

    n = 256
    for _ in range(8):
        t = timed(kernel_for(n))
        new = max(8, min(16384, round(n * (target_s / max(t, 1e-7)) ** (1 / 3))))
        if abs(new - n) <= max(2, n // 50):
            break
        n = new
    return n, kernel_for(n)


def measure_device(cfg: dict[str, Any]) -> PipelineBenchResult:
    try:
        import torch

        from lw_vllm.device.copier import TorchCopier
    except ImportError as e:
        raise SystemExit(
            "lw-bench pipeline --kv-device needs torch and lw_vllm's copier (pip install -e packages/lw-vllm, or "
            f"PYTHONPATH=packages/lw-vllm/src where vLLM cannot be installed): {e}"
        ) from None
    from tqdm import tqdm

    from lw_core.pipeline import LayerPipeline
    from lw_core.plan import ObjectLayout, ReqLoad, ReqSave

    acc = _Accel(cfg["kv_device"])
    dev = acc.device
    layers, blocks, bb, reps, depths = cfg["layers"], cfg["blocks"], cfg["block_bytes"], cfg["reps"], cfg["depths"]
    layout = ObjectLayout(layer_nbytes=(bb,) * layers)
    total = layout.nbytes * blocks
    keys = [f"bench/{i}" for i in range(blocks)]
    backend, tmp = open_backend(cfg, total)
    try:
        g = torch.Generator(device=dev).manual_seed(1)
        src_kv = [torch.randint(0, 256, (blocks, bb), dtype=torch.uint8, device=dev, generator=g) for _ in range(layers)]
        dst_kv = [torch.zeros(blocks, bb, dtype=torch.uint8, device=dev) for _ in range(layers)]
        src, dst = TorchCopier(src_kv, blocks, ops=acc.ops), TorchCopier(dst_kv, blocks, ops=acc.ops)
        t0 = time.perf_counter()
        with LayerPipeline(backend, src, layout, save_timeout_s=60.0) as pipe:
            pipe.start_save([ReqSave("bench", keys, list(range(blocks)))])
            for layer in range(layers):
                pipe.save_layer(layer)
            saved = pipe.finish_save()
        t_save = time.perf_counter() - t0
        if len(saved.committed_keys) + len(saved.skipped_keys) != blocks:
            raise SystemExit(f"lw-bench pipeline: could not fill the pool from the device: {saved.errors}")
        loads = [ReqLoad("bench", keys, list(range(blocks)))]
        failures: list[int] = []
        errors: list[str] = []
        verified = True
        waits: dict[str, list[float]] = {}

        def step(pipe: Any, compute: Any, tag: str) -> float:
            nonlocal verified
            dst_kv[0][0].zero_()  # a run that loads nothing would leave it 0
            acc.sync()
            t0 = time.perf_counter()
            pipe.start_load(loads)
            if pipe.layerwise:
                for layer in range(layers):
                    pipe.wait_layer(layer)
                    compute()
            elif compute is not None:
                for _ in range(layers):
                    compute()
            res = pipe.finish_load()
            acc.sync()
            dt = time.perf_counter() - t0
            failures.append(len(res.failed_block_ids))
            errors.extend(e for e in res.errors if e not in errors)
            waits.setdefault(tag, []).append(sum(res.layer_wait_s))
            if not all(torch.equal(dst_kv[i], src_kv[i]) for i in range(layers)):
                verified = False
            return dt

        def fresh(**kw: Any) -> Any:
            return LayerPipeline(backend, dst, layout, layer_timeout_s=30.0, **kw)

        bulk_pipe = fresh(layerwise=False)
        step(bulk_pipe, None, "warmup")
        t_transfer_layer = _median([step(bulk_pipe, None, "warmup") for _ in range(3)]) / layers
        target = cfg["compute_ms"] / 1e3 if cfg["compute_ms"] else t_transfer_layer
        n, kernel = _calibrate(acc, target)
        lw_pipes = {d: fresh(prefetch_depth=d) for d in depths}
        samples: dict[str, list[float]] = {
            k: [] for k in ["compute", "transfer", "bulk", *(f"layerwise_{d}" for d in depths), "raw_copy", "raw_overlap"]
        }
        pinned = [acc.pinned(blocks * bb) for _ in range(layers)]
        raw_dst = [t.reshape(-1) for t in dst_kv]
        side = acc.side()

        def raw_enqueue() -> None:
            with side:
                for i in range(layers):
                    raw_dst[i].copy_(pinned[i], non_blocking=True)

        def timed(fn: Any) -> float:
            acc.sync()
            t0 = time.perf_counter()
            fn()
            acc.sync()
            return time.perf_counter() - t0

        def compute_all() -> None:
            for _ in range(layers):
                kernel()

        def raw_overlap() -> None:
            raw_enqueue()
            compute_all()

        try:
            for p in lw_pipes.values():
                step(p, kernel, "warmup")
            with tqdm(total=reps * len(samples), desc="lw-bench pipeline", file=sys.stderr, unit="run") as bar:
                for _ in range(reps):
                    samples["compute"].append(timed(compute_all))
                    bar.update()
                    samples["transfer"].append(step(bulk_pipe, None, "transfer"))
                    bar.update()
                    samples["bulk"].append(step(bulk_pipe, kernel, "bulk"))
                    bar.update()
                    for d, p in lw_pipes.items():
                        samples[f"layerwise_{d}"].append(step(p, kernel, str(d)))
                        bar.update()
                    samples["raw_copy"].append(timed(raw_enqueue))
                    bar.update()
                    samples["raw_overlap"].append(timed(raw_overlap))
                    bar.update()
        finally:
            bulk_pipe.close()
            for p in lw_pipes.values():
                p.close()
    finally:
        backend.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    name = "cpu (inline copies)" if acc.inline else torch.accelerator.current_accelerator().type
    if not acc.inline and dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    config = {"layers": layers, "blocks": blocks, "block_bytes": bb, "layer_bytes": bb * blocks,
              "total_bytes": total, "reps": reps, "depths": depths, "backend": cfg["backend"],
              "compute_ms_target": target * 1e3, "matmul_n": n, "blas_threads_env": {},
              "kv_device": str(dev) if not acc.inline else "cpu-torch", "device_name": name,
              "torch": str(torch.__version__)}
    return summarize(config, samples, waits, failures, errors, verified, save_s=t_save)
