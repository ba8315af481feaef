"""``lw-bench pipeline --kv-device DEV``: the pipeline bench with the KV cache on a torch device.

The same scenarios and figures as the CPU bench (``pipeline_bench``, the same step loop:
``pipeline_steps``), but the "KV cache" is one uint8 tensor per layer on the device, copies go
through lw_vllm's ``TorchCopier`` device path (``--mechanism``: straight between the registered
pool and the blocks, or staged; side streams ordered by events), and compute is a float32 matmul
per layer on the device's compute stream. ``--rates`` adds the rate of each mechanism against the
pinned-DMA ceiling at several segment sizes (``pipeline_rates``), ``--model-shaped`` a dense
prefill of a named model shape against the load of its prefix (``pipeline_model``). Every step ends with a device synchronize, so its time
includes the copies. The ceiling (``raw_*``) is a plain host->device DMA of the same bytes from
pinned memory on a side stream, alone and next to the same compute.

Imports torch and lw_vllm lazily (this module is loaded only in device mode), so lw-core stays
free of both. ``cpu-torch`` runs this code on CPU tensors with inline copies: a smoke test of the
device mode on a machine without a device, with no overlap to show.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from typing import TYPE_CHECKING, Any

from lw_bench.bench_store import open_for_pipeline as open_backend
from lw_bench.pipeline_model import measure_model
from lw_bench.pipeline_rates import measure_host_work, measure_rates
from lw_bench.pipeline_result import PipelineBenchResult
from lw_bench.pipeline_steps import median, summarize

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
        return median(ts)

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
    from lw_bench.pipeline_steps import StepLoop, run_scenarios
    from lw_core.pipeline import LayerPipeline
    from lw_core.plan import ObjectLayout, ReqLoad, ReqSave

    acc = _Accel(cfg["kv_device"])
    dev = acc.device
    layers, blocks, bb, mechanism = cfg["layers"], cfg["blocks"], cfg["block_bytes"], cfg.get("mechanism", "auto")
    layout = ObjectLayout(layer_nbytes=(bb,) * layers)
    total = layout.nbytes * blocks
    keys = [f"bench/{i}" for i in range(blocks)]
    backend, tmp = open_backend(cfg, total)
    src = dst = None
    try:
        g = torch.Generator(device=dev).manual_seed(1)
        src_kv = [torch.randint(0, 256, (blocks, bb), dtype=torch.uint8, device=dev, generator=g) for _ in range(layers)]
        dst_kv = [torch.zeros(blocks, bb, dtype=torch.uint8, device=dev) for _ in range(layers)]
        src = TorchCopier(src_kv, blocks, ops=acc.ops, mechanism=mechanism)
        dst = TorchCopier(dst_kv, blocks, ops=acc.ops, mechanism=mechanism)
        t0 = time.perf_counter()
        with LayerPipeline(backend, src, layout, save_timeout_s=60.0) as pipe:
            pipe.start_save([ReqSave("bench", keys, list(range(blocks)))])
            for layer in range(layers):
                pipe.save_layer(layer)
            saved = pipe.finish_save()
        acc.sync()
        t_save = time.perf_counter() - t0
        if len(saved.committed_keys) + len(saved.skipped_keys) != blocks:
            raise SystemExit(f"lw-bench pipeline: could not fill the pool from the device: {saved.errors}")

        def reset() -> None:
            dst_kv[0][0].zero_()

        loop = StepLoop([ReqLoad("bench", keys, list(range(blocks)))], layers, sync=acc.sync, reset=reset,
                        verify=lambda: all(torch.equal(dst_kv[i], src_kv[i]) for i in range(layers)))
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

        def compute_all(kernel: Any) -> float:
            return timed(lambda: [kernel() for _ in range(layers)])

        def raw_overlap(kernel: Any) -> float:
            def both() -> None:
                raw_enqueue()
                for _ in range(layers):
                    kernel()

            return timed(both)

        samples, n, target = run_scenarios(
            loop, lambda **kw: LayerPipeline(backend, dst, layout, layer_timeout_s=30.0, **kw),
            lambda t: _calibrate(acc, t), cfg, compute_all=compute_all, raw_copy=lambda: timed(raw_enqueue),
            raw_overlap=raw_overlap)
        counts = dst.mechanism_counts
    finally:
        for c in (src, dst):
            if c is not None:
                c.close()
        backend.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    rates = measure_rates(acc, cfg) if cfg.get("rates") else None
    if cfg.get("model_shaped") and rates is None:
        rates = measure_rates(acc, cfg, only=["model"])
    model = measure_model(acc, cfg, rates) if cfg.get("model_shaped") else None
    host = measure_host_work(acc, cfg) if cfg.get("host_work") else None
    name = device_name(acc)
    config = {"layers": layers, "blocks": blocks, "block_bytes": bb, "layer_bytes": bb * blocks,
              "total_bytes": total, "reps": cfg["reps"], "depths": cfg["depths"], "backend": cfg["backend"],
              "compute_ms_target": target * 1e3, "matmul_n": n, "blas_threads_env": {},
              "kv_device": str(dev) if not acc.inline else "cpu-torch", "device_name": name,
              "torch": str(torch.__version__), "mechanism": mechanism}
    return summarize(config, samples, loop.waits, loop.failures, loop.errors, loop.verified, save_s=t_save,
                     mechanism_counts=counts, rates=rates, model_shaped=model, host_work=host)


def device_name(acc: _Accel) -> str:
    torch = acc.torch
    if acc.inline:
        return "cpu (inline copies)"
    if acc.device.type == "cuda":
        return str(torch.cuda.get_device_name(acc.device))
    return str(torch.accelerator.current_accelerator().type)
