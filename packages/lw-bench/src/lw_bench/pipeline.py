"""``lw-bench pipeline``: how much of the pool->KV transfer the layer pipeline hides behind compute.

Real transfers: the KV bytes are first saved through the pipeline into a pool (the embedded
backend by default, on tmpfs), then loaded back into a numpy "KV cache" (``HostCopier``). Compute
is a real CPU kernel: a float32 matmul per layer, sized at start-up to a target time per layer
(by default the measured per-layer transfer time, so compute and transfer are of similar size).

Scenarios, each timed ``--reps`` times (median reported):

* no pool   -- compute only, every layer: ``t_compute_s``
* transfer  -- bulk load alone, no compute: ``t_transfer_s``
* bulk      -- load every layer, then compute every layer: ``t_bulk_s``
* layerwise -- for each layer: ``wait_layer`` then compute, prefetch depth 1..N: ``t_layerwise_s``

``hidden_fraction[d] = (t_bulk - t_layerwise[d]) / min(t_compute, t_transfer)``: 1.0 means the
shorter of transfer and compute is entirely hidden; 0 means no overlap at all. Depth 1 has no
prefetch (the load of layer L starts at ``wait_layer(L)``), so expect ~0 there.

The measurement runs in a child process whose BLAS is limited to one thread
(``OPENBLAS_NUM_THREADS=1`` etc. must be set before numpy loads): the matmul then holds one core
and the transfer thread (numpy memcpy, GIL released) gets the other.

The report is a ``lw_bench.pipeline_result.PipelineBenchResult`` (its fields are the JSON's keys;
``run`` returns it as a dict). ``t_raw_copy_s``, ``t_raw_overlap_s`` and ``raw_hidden_fraction`` are
the machine's own ceiling -- a plain numpy memcpy of the same bytes (KV to KV, no pool, no pipeline)
alone, and in one thread next to the same compute. On a machine shared with other work this is
well below 1.0, and the pipeline cannot do better than it.

``--kv-device DEV`` puts the KV cache on a torch device (``pipeline_device``; the same struct, with
the device fields of its config and ``save_s``, the initial save's time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any

import msgspec

from lw_bench import bench_store, pipeline_result, pipeline_steps
from lw_bench.bench_store import open_for_pipeline as open_backend

_CFG_ENV = "LW_PIPELINE_BENCH_CFG"
_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32, help="number of layers (default 32)")
    p.add_argument("--blocks", type=int, default=64, help="KV blocks loaded per step (default 64)")
    p.add_argument("--block-bytes", type=int, default=128 << 10, help="bytes of one block of one layer (default 131072)")
    p.add_argument("--compute-ms", type=float, default=None, help="target compute per layer in ms (default: the measured per-layer transfer time)")
    p.add_argument("--depths", type=str, default="1,2,3,4", help="prefetch depths to run, comma-separated (default 1,2,3,4)")
    p.add_argument("--reps", type=int, default=7, help="repetitions per scenario; medians are reported (default 7)")
    p.add_argument("--backend", default="embedded", help="memory, or a backend plugin on its throwaway bench pool "
                   "(embedded, mooncake: run it in a network namespace, its clients listen on every address)")
    bench_store.add_argument(p)
    p.add_argument("--pool-path", default=None, help="embedded pool directory (default: a fresh one on /dev/shm, removed after)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a bar chart (needs matplotlib: pip install 'lw-bench[plot]')")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (4 layers, 8 blocks, 1 rep, depths 1,2)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up on the measurement after this long (default 1800)")
    p.add_argument(
        "--kv-device", default="cpu", metavar="DEV",
        help="where the KV cache lives: cpu (numpy, default) or a torch device such as cuda, cuda:1, npu:0 "
        "(device copies through lw_vllm's TorchCopier, compute = a matmul on that device; needs torch); "
        "cpu-torch runs the device mode's code on CPU tensors (a smoke test, no overlap to show)",
    )
    p.add_argument("--mechanism", default="auto", choices=["auto", "kernel", "batch_dma", "staged"],
                   help="device mode: how the copier moves batches in registered pool memory (device_copy_mechanism; default auto)")
    p.add_argument("--rates", action="store_true",
                   help="device mode: also each mechanism's pool rate against the pinned-DMA ceiling at 16/64/256 KiB "
                   "segments and the model-shaped size (32 layers x 512 blocks x 64 KiB)")
    p.add_argument("--host-work", action="store_true",
                   help="with --kv-device cpu-torch: also the host's own work per window of the device path "
                   "(copies that move nothing) at the --rates cases, and the rate it alone allows")
    p.add_argument("--model-shaped", default="", metavar="SHAPE[,SHAPE]",
                   help="device mode: also time a dense prefill of these shapes (llama3-8b, llama3-70b, tiny) against "
                   "loading their prefix at the measured rates")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {
        "layers": args.layers,
        "blocks": args.blocks,
        "block_bytes": args.block_bytes,
        "compute_ms": args.compute_ms,
        "depths": args.depths,
        "reps": args.reps,
        "backend": args.backend,
        "pool_path": args.pool_path,
        "backend_keys": bench_store.parse_keys("pipeline", getattr(args, "backend_key", None)),
        "kv_device": getattr(args, "kv_device", "cpu") or "cpu",
        "mechanism": getattr(args, "mechanism", "auto"),
        "rates": bool(getattr(args, "rates", False)),
        "host_work": bool(getattr(args, "host_work", False)),
        "model_shaped": [x.strip() for x in str(getattr(args, "model_shaped", "") or "").split(",") if x.strip()],
        "quick": bool(args.quick),
    }
    if args.quick:
        cfg.update(layers=4, blocks=8, block_bytes=16 << 10, reps=1, depths="1,2")
    try:
        depths = sorted({int(d) for d in str(cfg["depths"]).split(",") if d.strip()})
    except ValueError:
        raise SystemExit(f"lw-bench pipeline: --depths={cfg['depths']!r} must be comma-separated integers >= 1, e.g. 1,2,4") from None
    cfg["depths"] = depths
    for name in ("layers", "blocks", "block_bytes", "reps"):
        if cfg[name] < 1:
            raise SystemExit(f"lw-bench pipeline: --{name.replace('_', '-')}={cfg[name]} must be >= 1")
    if not depths or depths[0] < 1:
        raise SystemExit(f"lw-bench pipeline: --depths={args.depths!r} must list integers >= 1")
    if cfg["compute_ms"] is not None and not cfg["compute_ms"] > 0:
        raise SystemExit(f"lw-bench pipeline: --compute-ms={cfg['compute_ms']} must be > 0")
    if cfg["backend"] == "memory":
        if cfg["backend_keys"]:
            raise SystemExit("lw-bench pipeline --backend-key: the memory backend has no keys")
    else:
        bench_store.check_keys("pipeline", cfg["backend"], cfg["backend_keys"])
        bench_store.plugin_of("pipeline", cfg["backend"])
    if cfg["kv_device"] == "cpu" and (cfg["rates"] or cfg["model_shaped"] or cfg["mechanism"] != "auto"):
        raise SystemExit("lw-bench pipeline: --rates, --model-shaped and --mechanism need --kv-device (a torch device, or cpu-torch)")
    if cfg["host_work"] and cfg["kv_device"] != "cpu-torch":
        raise SystemExit(f"lw-bench pipeline: --host-work needs --kv-device cpu-torch (got --kv-device={cfg['kv_device']}): "
                         "it times the host's part of the device path with copies that move nothing")
    shapes = ("llama3-8b", "llama3-70b", "tiny")
    bad = [x for x in cfg["model_shaped"] if x not in shapes]
    if bad:
        raise SystemExit(f"lw-bench pipeline: --model-shaped={bad[0]!r} is not a known shape; accepted: {', '.join(shapes)}")
    if cfg["kv_device"] != "cpu-torch" and not re.fullmatch(r"[a-z]+(:[0-9]+)?", str(cfg["kv_device"])):
        raise SystemExit(f"lw-bench pipeline: --kv-device={cfg['kv_device']!r} must be cpu, cpu-torch or a torch device such as cuda, cuda:0, npu:0")
    return cfg


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    if args.plot:
        _require_matplotlib()
    env = dict(os.environ, **{k: "1" for k in _BLAS_ENV}, **{_CFG_ENV: json.dumps(cfg)})
    cmd = [sys.executable, "-c", "from lw_bench.pipeline import _child; _child()"]
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"lw-bench pipeline: the measurement did not finish within --timeout-s={args.timeout_s}") from None
    if proc.returncode != 0:
        raise SystemExit(f"lw-bench pipeline: the measurement process failed (exit {proc.returncode}); see its messages above")
    try:
        res = pipeline_result.decode(proc.stdout.strip().splitlines()[-1])
    except msgspec.ValidationError as e:
        raise SystemExit(f"lw-bench pipeline: the measurement reported a result that is not a PipelineBenchResult: {e}") from None
    if args.plot:
        res.plot = args.plot
    result: dict[str, Any] = msgspec.to_builtins(res)
    if args.plot:
        _plot(result, args.plot)
    if not getattr(args, "json", False):
        _print_table(result)
    return result


def _child() -> None:
    cfg = json.loads(os.environ[_CFG_ENV])
    if cfg.get("kv_device", "cpu") != "cpu":
        from lw_bench.pipeline_device import measure_device  # imports torch: device mode only

        print(pipeline_result.encode(measure_device(cfg)).decode())
        return
    print(pipeline_result.encode(measure(cfg)).decode())


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("lw-bench pipeline --plot needs matplotlib: pip install 'lw-bench[plot]' (or pip install matplotlib)") from None


def _plot(r: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted(r["t_layerwise_s"], key=int)
    labels = ["compute\n(no pool)", "transfer\nonly", "bulk"] + [f"layerwise\ndepth {d}" for d in depths]
    vals = [r["t_compute_s"], r["t_transfer_s"], r["t_bulk_s"]] + [r["t_layerwise_s"][d] for d in depths]
    fig, ax = plt.subplots(figsize=(2 + 1.1 * len(labels), 4))
    bars = ax.bar(labels, [v * 1e3 for v in vals], color=["#888", "#bbb", "#c44"] + ["#48c"] * len(depths))
    for b, d in zip(bars[3:], depths):
        ax.annotate(f"hidden {r['hidden_fraction'][d]:.0%}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    c = r["config"]
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{c['layers']} layers x {c['blocks']} blocks x {c['block_bytes'] // 1024} KiB, {c['backend']} pool", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _print_table(r: dict[str, Any]) -> None:
    c = r["config"]
    print(
        f"pipeline bench: {c['layers']} layers, {c['blocks']} blocks x {c['block_bytes']} B per layer "
        f"({c['total_bytes'] / 2**20:.1f} MiB per step), {c['backend']} pool, KV on {c.get('kv_device', 'cpu')}, "
        f"median of {c['reps']}"
    )
    print(f"  compute only   {r['t_compute_s'] * 1e3:8.2f} ms   ({r['per_layer_compute_ms']:.3f} ms/layer, matmul n={c['matmul_n']})")
    print(f"  transfer only  {r['t_transfer_s'] * 1e3:8.2f} ms   ({r['per_layer_transfer_ms']:.3f} ms/layer, {r['transfer_gbps']:.2f} GB/s)")
    print(f"  bulk           {r['t_bulk_s'] * 1e3:8.2f} ms")
    for d in sorted(r["t_layerwise_s"], key=int):
        print(
            f"  layerwise d={d}  {r['t_layerwise_s'][d] * 1e3:8.2f} ms   hidden {r['hidden_fraction'][d]:6.1%}   "
            f"blocked in wait_layer {r['layer_wait_ms'][d]:.2f} ms"
        )
    raw = "host->device DMA on a side stream" if c.get("kv_device", "cpu") != "cpu" else "memcpy thread"
    print(
        f"  machine ceiling: plain {raw} next to compute hides {r['raw_hidden_fraction']:.1%} "
        f"(copy {r['t_raw_copy_s'] * 1e3:.2f} ms alone, {r['t_raw_overlap_s'] * 1e3:.2f} ms with compute)"
    )
    print(f"  verified={r['verified']} load_failures={r['load_failures']}")
    if r.get("mechanism_counts") is not None:
        moved = ", ".join(f"{k} {v}" for k, v in r["mechanism_counts"].items() if v) or "nothing"
        print(f"  copier mechanism {c.get('mechanism')}: load batches moved by {moved}")
    from lw_bench.pipeline_tables import host_lines, model_lines, rate_lines

    if r.get("rates"):
        print("pool rates against the pinned-DMA ceiling (same run):")
        print("\n".join(rate_lines(r["rates"])))
    if r.get("model_shaped"):
        print("a pool hit against recomputing the prefix (dense prefill on the device):")
        print("\n".join(model_lines(r["model_shaped"])))
    if r.get("host_work"):
        print("the host's own work per window, copies moving nothing (--host-work):")
        print("\n".join(host_lines(r["host_work"])))


# --- the measurement (runs in the child; numpy is imported only here, after the BLAS env is set) ---




def _calibrate_matmul(target_s: float) -> tuple[int, Any]:
    """Pick n so that one float32 n x n matmul takes about ``target_s``; returns (n, kernel)."""
    import time

    import numpy as np

    def kernel_for(n: int) -> Any:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        c = np.empty((n, n), dtype=np.float32)
        return lambda: np.matmul(a, b, out=c)

    def timed(k: Any) -> float:
        k()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            k()
            ts.append(time.perf_counter() - t0)
        return pipeline_steps.median(ts)

    n = 128
    for _ in range(6):
        t = timed(kernel_for(n))
        new = max(8, min(8192, round(n * (target_s / max(t, 1e-7)) ** (1 / 3))))
        if abs(new - n) <= max(2, n // 50):
            break
        n = new
    return n, kernel_for(n)


def measure(cfg: dict[str, Any]) -> pipeline_result.PipelineBenchResult:
    import shutil
    import threading
    import time

    import numpy as np

    from lw_bench.pipeline_steps import StepLoop, run_scenarios
    from lw_core.pipeline import LayerPipeline
    from lw_core.pipeline.host_copier import HostCopier
    from lw_core.plan import ObjectLayout, ReqLoad, ReqSave

    layers, blocks, bb = cfg["layers"], cfg["blocks"], cfg["block_bytes"]
    layout = ObjectLayout(layer_nbytes=(bb,) * layers)
    total = layout.nbytes * blocks
    keys = [f"bench/{i}" for i in range(blocks)]
    backend, tmp = open_backend(cfg, total)
    try:
        src = HostCopier.allocate(layers, blocks, bb, fill=None)
        rng = np.random.default_rng(1)
        for a in src.kv:
            a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)
        dst = HostCopier.allocate(layers, blocks, bb, fill=0)
        with LayerPipeline(backend, src, layout, save_timeout_s=60.0) as pipe:
            pipe.start_save([ReqSave("bench", keys, list(range(blocks)))])
            for layer in range(layers):
                pipe.save_layer(layer)
            saved = pipe.finish_save()
        if len(saved.committed_keys) + len(saved.skipped_keys) != blocks:
            raise SystemExit(f"lw-bench pipeline: could not fill the pool: {saved.errors}")

        def reset() -> None:
            dst.kv[0][:1] = 0  # cheap marker: a run that loads nothing would leave it 0

        loop = StepLoop([ReqLoad("bench", keys, list(range(blocks)))], layers, sync=lambda: None, reset=reset,
                        verify=lambda: all(np.array_equal(dst.kv[i], src.kv[i]) for i in range(layers)))
        raw_src = [a.reshape(-1) for a in src.kv]
        raw_dst = [a.reshape(-1) for a in dst.kv]

        def copy_all() -> None:
            for i in range(layers):
                np.copyto(raw_dst[i], raw_src[i])

        def timed(fn: Any) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def compute_all(kernel: Any) -> float:
            return timed(lambda: [kernel() for _ in range(layers)])

        def raw_overlap(kernel: Any) -> float:
            # the machine's own limit: one plain numpy memcpy thread next to the same compute
            def both() -> None:
                th = threading.Thread(target=copy_all)
                th.start()
                for _ in range(layers):
                    kernel()
                th.join()

            return timed(both)

        samples, n, target = run_scenarios(
            loop, lambda **kw: LayerPipeline(backend, dst, layout, layer_timeout_s=30.0, **kw), _calibrate_matmul, cfg,
            compute_all=compute_all, raw_copy=lambda: timed(copy_all), raw_overlap=raw_overlap)
    finally:
        backend.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    config = {"layers": layers, "blocks": blocks, "block_bytes": bb, "layer_bytes": bb * blocks,
              "total_bytes": total, "reps": cfg["reps"], "depths": cfg["depths"], "backend": cfg["backend"],
              "backend_keys": cfg.get("backend_keys") or {},
              "compute_ms_target": target * 1e3, "matmul_n": n,
              "blas_threads_env": {k: os.environ.get(k) for k in _BLAS_ENV[:2]}}
    return pipeline_steps.summarize(config, samples, loop.waits, loop.failures, loop.errors, loop.verified)
