"""``lw-bench pipeline --kv-device DEV --rates``: how fast each copy mechanism moves a step's KV
between the pool and the device, against the pinned-DMA ceiling measured in the same run.

Cases: 32 MiB per layer at 16, 64 and 256 KiB segments (8 layers each), and a model-shaped one: 32
layers x 512 blocks x 64 KiB (1 GiB: an 8B model's 8k-token prefix). Per case and mechanism
(``staged``, ``kernel``, ``batch_dma`` where the device offers it): saves through the pipeline (no
compute; reserve, copies, commit: ``save_gbps``), then loads (bulk: every layer at once, leases
and release included: ``load_gbps``), every load's bytes verified. The ceiling is a plain DMA of
the same bytes between one pinned buffer and the KV tensors on a side stream. Each row says which
mechanisms really moved the batches (``used``): one the device lacks falls back.

``--host-work`` (``measure_host_work``, with ``--kv-device cpu-torch``): the same cases through the
same pipeline and copier, with device ops whose copies move nothing (``NoCopyOps``): what is left is
the host's own work per window, which bounds a device's rate however fast its copies run (a 16 KiB
window at 0.70 of a 55 GB/s link must cost the host under 430 ns). ``kernel`` and ``batch_dma``
only: ``staged`` is a host memcpy itself.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from typing import Any

from lw_bench.bench_store import open_for_pipeline as open_backend
from lw_bench.pipeline_result import HostRow, RateRow
from lw_core.backend import BackendError, supports_purge

CASES = [  # name, layers, blocks, bytes of one block of one layer
    ("16 KiB", 8, 2048, 16 << 10),
    ("64 KiB", 8, 512, 64 << 10),
    ("256 KiB", 8, 128, 256 << 10),
    ("model", 32, 512, 64 << 10),
]
QUICK_CASES = [("16 KiB", 2, 16, 16 << 10), ("64 KiB", 2, 8, 64 << 10), ("model", 2, 8, 64 << 10)]
SAVE_BYTES = 1 << 30  # timed saves per mechanism: 2, or 1 where that is more than this (the pool holds each)


def mechanisms(acc: Any) -> list[str]:
    from lw_vllm.device.device_streams import TorchDeviceOps

    ops = acc.ops if acc.ops is not None else TorchDeviceOps(acc.device)
    return ["staged", "kernel"] + (["batch_dma"] if ops.can_batch_copy else [])


def _timed(acc: Any, fn: Any) -> float:
    acc.sync()
    t0 = time.perf_counter()
    fn()
    acc.sync()
    return time.perf_counter() - t0


def _ceiling(acc: Any, kv: list[Any], reps: int) -> tuple[float, float]:
    """Pinned DMA of the case's bytes, host -> device and back, GB/s (medians)."""
    layer_bytes = kv[0].numel()
    pinned = acc.pinned(layer_bytes)
    flat = [t.reshape(-1) for t in kv]
    side = acc.side()

    def h2d() -> None:
        with side:
            for f in flat:
                f.copy_(pinned, non_blocking=True)

    def d2h() -> None:
        with side:
            for f in flat:
                pinned.copy_(f, non_blocking=True)

    total = layer_bytes * len(kv)
    h2d()
    d2h()
    up = statistics.median(_timed(acc, h2d) for _ in range(reps))
    down = statistics.median(_timed(acc, d2h) for _ in range(reps))
    return total / up / 1e9, total / down / 1e9


def _save(acc: Any, backend: Any, copier: Any, layout: Any, keys: list[str]) -> float:
    from lw_core.pipeline import LayerPipeline
    from lw_core.plan import ReqSave

    def run() -> None:
        with LayerPipeline(backend, copier, layout, save_timeout_s=120.0) as pipe:
            pipe.start_save([ReqSave("bench", keys, list(range(len(keys))))])
            for layer in range(layout.num_layers):
                pipe.save_layer(layer)
            res = pipe.finish_save()
        if len(res.committed_keys) != len(keys):
            raise SystemExit(f"lw-bench pipeline --rates: saves failed: {res.errors[:3]}")

    return _timed(acc, run)


def _loads(acc: Any, backend: Any, copier: Any, layout: Any, keys: list[str], src: list[Any] | None,
           dst: list[Any], reps: int, pick: Any = statistics.median) -> tuple[float, bool]:
    """``pick`` (median) of the times of ``reps`` bulk loads (after one warm-up), and whether every
    one was exact; with ``src`` None (copies that move nothing) the KV is neither reset nor checked."""
    import torch

    from lw_core.pipeline import LayerPipeline
    from lw_core.plan import ReqLoad

    loads = [ReqLoad("bench", keys, list(range(len(keys))))]
    times: list[float] = []
    verified = True
    with LayerPipeline(backend, copier, layout, layerwise=False, layer_timeout_s=120.0) as pipe:

        def load() -> None:
            pipe.start_load(loads)
            res = pipe.finish_load()
            if res.failed_block_ids:
                raise SystemExit(f"lw-bench pipeline --rates: loads failed: {res.errors[:3]}")

        for r in range(reps + 1):
            for t in dst if src is not None else ():
                t.zero_()
            dt = _timed(acc, load)
            if r:
                times.append(dt)
            verified = verified and src is not None and all(torch.equal(d, s) for d, s in zip(dst, src))
    return pick(times), verified


def _case_pool(cfg: dict[str, Any], purging: int, keeping: int) -> tuple[Any, str | None, bool]:
    """A pool for one case: ``purging`` bytes when the backend can purge objects (the case purges
    what it no longer needs, untimed, so the pool, a tmpfs file whose pages are taken when it is
    made and registered with the device, stays small), else ``keeping`` bytes, room for every
    object the case writes. Returns the backend, its temporary directory and whether it purges."""
    backend, tmp = open_backend(cfg, purging)
    if supports_purge(backend):
        return backend, tmp, True
    backend.close()
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    backend, tmp = open_backend(cfg, keeping)
    return backend, tmp, False


def measure_rates(acc: Any, cfg: dict[str, Any], only: list[str] | None = None) -> list[RateRow]:
    import torch

    from lw_core.plan import ObjectLayout
    from lw_vllm.device.copier import TorchCopier

    cases = QUICK_CASES if cfg.get("quick") else CASES
    mechs = mechanisms(acc)
    reps = max(2, cfg["reps"])
    rows: list[RateRow] = []
    for name, layers, blocks, bb in cases:
        if only is not None and name not in only:
            continue
        layout = ObjectLayout((bb,) * layers)
        total = layout.nbytes * blocks
        g = torch.Generator(device=acc.device).manual_seed(2)
        src = [torch.randint(0, 256, (blocks, bb), dtype=torch.uint8, device=acc.device, generator=g) for _ in range(layers)]
        dst = [torch.zeros(blocks, bb, dtype=torch.uint8, device=acc.device) for _ in range(layers)]
        ceil_load, ceil_save = _ceiling(acc, dst, reps)
        saves = 2 if total * 2 <= SAVE_BYTES else 1
        try:
            step = total * saves + 4 * layout.nbytes  # one mechanism's objects (each is purged before the next)
            backend, tmp, purges = _case_pool(cfg, step, step * len(mechs))
        except (BackendError, OSError) as e:  # e.g. /dev/shm too small for the case: say so, go on
            print(f"lw-bench pipeline --rates: case {name} skipped: no pool of its size here: {e}", file=sys.stderr)
            continue
        copiers: list[Any] = []  # closed at the case's end: the pool stays registered for every mechanism
        try:
            for m in mechs:
                cs = TorchCopier(src, blocks, ops=acc.ops, mechanism=m)
                cd = TorchCopier(dst, blocks, ops=acc.ops, mechanism=m)
                copiers += [cs, cd]
                key = f"{name}/{m}".replace(" ", "")  # a --pool-path pool may be reused by the next case
                error = None
                before = _counters(backend)
                try:
                    _save(acc, backend, cs, layout, [f"{key}/warm/{i}" for i in range(4)])
                    t_save = statistics.median(
                        _save(acc, backend, cs, layout, [f"{key}/{r}/{i}" for i in range(blocks)]) for r in range(saves))
                    t_load, verified = _loads(acc, backend, cd, layout, [f"{key}/0/{i}" for i in range(blocks)], src, dst, reps)
                except (Exception, SystemExit) as e:  # one mechanism failing must not cost the others' figures
                    error, t_save, t_load, verified = f"{type(e).__name__}: {e}"[:300], float("inf"), float("inf"), False
                    print(f"lw-bench pipeline --rates: {name} {m}: {error}", file=sys.stderr)
                moved = _counters(backend)
                store_counts = {k: v - before.get(k, 0) for k, v in moved.items() if v != before.get(k, 0)}
                if purges:  # the next mechanism's saves get the room back
                    _purge(backend, f"{key}/")
                used = {k: cs.mechanism_counts.get(k, 0) + cd.mechanism_counts.get(k, 0) for k in ("kernel", "batch_dma", "staged")}
                load_gbps, save_gbps = total / t_load / 1e9, total / t_save / 1e9
                rows.append(RateRow(
                    case=name, layers=layers, blocks=blocks, segment_bytes=bb, total_bytes=total, mechanism=m,
                    load_gbps=load_gbps, save_gbps=save_gbps, ceiling_load_gbps=ceil_load, ceiling_save_gbps=ceil_save,
                    load_of_ceiling=load_gbps / ceil_load, save_of_ceiling=save_gbps / ceil_save, used=used,
                    verified=verified, error=error, store_counts=store_counts))
        finally:
            for c in copiers:
                c.close()
            backend.close()
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _counters(backend: Any) -> dict[str, int]:
    """The pool's integer counters (``Backend.stats``); none where it cannot say."""
    try:
        return {k: v for k, v in backend.stats().items() if type(v) is int}
    except Exception:  # noqa: BLE001 - a figure less, never a failed case
        return {}


def _purge(backend: Any, prefix: str) -> None:
    """Remove the objects under ``prefix`` so the next save has room."""
    left = backend.purge(prefix, 30.0)
    if left.get("leased"):
        raise SystemExit(f"lw-bench pipeline: {left['leased']} objects under {prefix!r} are still leased")


def measure_host_work(acc: Any, cfg: dict[str, Any]) -> list[HostRow]:
    """Per case and mechanism: the fastest of ``reps`` saves and of ``reps`` bulk loads of a step
    whose copies move nothing (the module docstring); ``acc``: the bench's cpu-torch device."""
    import torch

    from lw_core.plan import ObjectLayout
    from lw_vllm.device.copier import TorchCopier
    from lw_vllm.device.device_streams import NoCopyOps

    ops = NoCopyOps()
    reps = max(2, cfg["reps"])
    rows: list[HostRow] = []
    for name, layers, blocks, bb in QUICK_CASES if cfg.get("quick") else CASES:
        layout = ObjectLayout((bb,) * layers)
        total = layout.nbytes * blocks
        mechs = ("kernel", "batch_dma")
        # Room for the loads' objects and one more save: each later save's objects are purged
        # (untimed) before the next, so the pool (a tmpfs file, its pages taken when it is made)
        # stays at twice a step whatever the repetitions.
        try:
            backend, tmp, purges = _case_pool(cfg, 2 * total + 4 * layout.nbytes, total * reps * len(mechs) + 4 * layout.nbytes)
        except (BackendError, OSError) as e:
            print(f"lw-bench pipeline --host-work: case {name} skipped: no pool of its size here: {e}", file=sys.stderr)
            continue
        try:
            for m in mechs:
                kv = [torch.empty(blocks, bb, dtype=torch.uint8) for _ in range(layers)]
                copier = TorchCopier(kv, blocks, ops=ops, mechanism=m)
                key = f"host/{name}/{m}".replace(" ", "")
                try:
                    saves = []
                    for r in range(reps):
                        saves.append(_save(acc, backend, copier, layout, [f"{key}/{r}/{i}" for i in range(blocks)]))
                        if r and purges:
                            _purge(backend, f"{key}/{r}/")
                    t_save = min(saves)
                    t_load, _ = _loads(acc, backend, copier, layout, [f"{key}/0/{i}" for i in range(blocks)], None, kv,
                                       reps, pick=min)
                    used = dict(copier.mechanism_counts)
                finally:
                    copier.close()
                if purges:
                    _purge(backend, f"{key}/")
                windows = layers * blocks
                rows.append(HostRow(
                    case=name, layers=layers, blocks=blocks, segment_bytes=bb, windows=windows, mechanism=m,
                    load_ns_per_window=t_load / windows * 1e9, save_ns_per_window=t_save / windows * 1e9,
                    load_bound_gbps=total / t_load / 1e9, save_bound_gbps=total / t_save / 1e9, used=used))
        finally:
            backend.close()
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
    return rows
