"""``lw-bench backend``: put/get throughput of a pool backend against a numpy memcpy of the same
bytes, measured in the same run (the ratio is the figure that survives a noisy machine).

Cases (every buffer is pre-touched; each figure is the best of ``--reps`` runs, backend and
memcpy runs alternating so both see the same moments of a noisy machine):

* ``64KiB`` / ``4MiB``: whole objects (puts run on a full pool: they include evictions). ``put`` = reserve + write + commit per batch of keys,
  ``get`` = open + read + release. The memcpy baseline copies the same objects one by one
  between numpy buffers of the same layout.
* ``layer_16KiB``: ``--batch`` objects of ``--layers`` x 16 KiB; ``put``/``get`` are the per-layer
  ranged write/read calls (one call per layer for the whole batch, as the layer pipeline does);
  ``ms_per_call`` is one layer's call. Their metadata calls are reported under ``metadata``.
* ``process: "other"``: a second process (spawned) attaches to the same pool and reads what this
  one wrote; its memcpy baseline is measured in that process.

The report is a ``lw_bench.backend_result.BackendBenchResult`` (its fields are the JSON's keys;
``run`` returns it as a dict).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import msgspec
import numpy as np
from tqdm import tqdm

from lw_bench import bench_store, netns
from lw_bench.backend_result import BackendBenchResult, BackendRow, Case, GetBreakdown, MetadataRow
from lw_core.backend import Backend, Handle
from lw_core.backends.embedded_defaults import LEASES_PER_PROCESS
from lw_core.backends.registry import backend_names, open_backend
from lw_core.config import parse_config

KiB, MiB = 1 << 10, 1 << 20
LAYER_BYTES = 16 * KiB
_CHILD_TIMEOUT_S = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="embedded",
                   help=f"store to measure: a backend plugin ({', '.join(backend_names())} installed)")
    p.add_argument("--path", default=None, help="embedded pool directory (default: a fresh temporary one on /dev/shm)")
    p.add_argument("--quick", action="store_true", help="small sizes and 2 repetitions (a few seconds)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per figure, best kept (default 5, quick 2)")
    p.add_argument("--batch", type=int, default=32, help="objects per batch call (default 32)")
    p.add_argument("--layers", type=int, default=None, help="layers of the layer_16KiB case (default 32, quick 4)")
    bench_store.add_argument(p)
    p.add_argument("--no-cross-process", action="store_true", help="skip the second-process read")
    p.add_argument("--host-tcp-netns", default=None, metavar="A,B",
                   help="memcache or mooncake (root): two hosts as network namespaces; the pool and this process run "
                        "on A, the cross-process reader on B, over host_tcp / Mooncake's TCP (rows 'other-host')")


# ----------------------------------------------------------------------------- measuring


def _pair(backend_fn: Callable[[], float | None], memcpy_fn: Callable[[], None], reps: int) -> tuple[float, float]:
    """Best seconds of the backend op and of its memcpy baseline, run alternately so both see the
    same moments of a noisy machine. ``backend_fn`` may return the seconds it measured itself."""
    best_b = best_m = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        own = backend_fn()
        best_b = min(best_b, own if own is not None else time.perf_counter() - t0)
        t0 = time.perf_counter()
        memcpy_fn()
        best_m = min(best_m, time.perf_counter() - t0)
    return best_b, best_m


def _memcpy_fn(size: int, count: int) -> Callable[[], None]:
    """Copy ``count`` objects of ``size`` one by one between two pre-touched numpy buffers: the
    same bytes, the same per-object calls as the backend op it is compared with."""
    src = _fill(size * count)
    dst = np.zeros_like(src)
    dst[:] = 1
    pairs = [(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count)]

    def go() -> None:
        for d, s in pairs:
            d[:] = s

    return go


def _row(case: Case, op: Literal["put", "get"], process: Literal["same", "other", "other-host"], obj: int, count: int,
         moved: int, s: float, mc: float, calls: int) -> BackendRow:
    gbps = moved / s / 1e9
    mgbps = moved / mc / 1e9
    return BackendRow(
        case=case,
        op=op,
        process=process,
        object_bytes=obj,
        objects=count,
        bytes=moved,
        gbps=round(gbps, 3),
        memcpy_gbps=round(mgbps, 3),
        ratio=round(gbps / mgbps, 3),
        ms_per_call=round(s / calls * 1e3, 4),
    )


def _fill(nbytes: int) -> np.ndarray:
    """Deterministic bytes, different in every object (251 is prime): a misplaced copy shows."""
    return np.resize(np.arange(251, dtype=np.uint8), nbytes)


def _whole_get(b: Backend, keys: list[str], n: int, batch: int, reps: int) -> tuple[float, float, list[float]]:
    """Best seconds of open + read + release of ``keys`` by batches, of its memcpy, and of each
    part (open, read, release: sums over the batches, each the best of the repetitions)."""
    dst = np.zeros(len(keys) * n, np.uint8)
    dst[:] = 1  # pre-touch
    views = [dst[i * n : (i + 1) * n] for i in range(len(keys))]
    parts = [float("inf")] * 3

    def go() -> None:
        t = [0.0, 0.0, 0.0]
        clock = time.perf_counter
        for i in range(0, len(keys), batch):
            t0 = clock()
            hs = _present(b.open(keys[i : i + batch]), f"objects {keys[i]}... vanished (pool too small?)")
            t1 = clock()
            b.read(hs, [0] * len(hs), views[i : i + batch])
            t2 = clock()
            b.release(hs)
            t3 = clock()
            t[0] += t1 - t0
            t[1] += t2 - t1
            t[2] += t3 - t2
        parts[:] = [min(p, x) for p, x in zip(parts, t)]

    s, mc = _pair(go, _memcpy_fn(n, len(keys)), reps)
    if not np.array_equal(dst, _fill(dst.size)):
        raise RuntimeError("lw-bench backend: read back wrong bytes")
    return s, mc, parts


def _breakdown(case: Case, process: Literal["same", "other", "other-host"], keys_per_call: int, calls: int,
               parts: list[float], mc: float, open_release_s: float | None = None) -> GetBreakdown:
    """Per call; the layer case's open and release (once per load) are not divided. Its load ratio
    counts ``open_release_s`` (the best of repeated open+release) where given, else the one open
    and release around the timed reads."""
    once = 1 if case == "layer_16KiB" else calls
    o, r, rel = (round(x / c * 1e3, 4) for x, c in zip(parts, (once, calls, once)))
    spent = parts[1] + (parts[0] + parts[2] if open_release_s is None else min(open_release_s, parts[0] + parts[2]))
    load = round(mc / spent, 4) if case == "layer_16KiB" and spent > 0 else None
    return GetBreakdown(case=case, process=process, keys_per_call=keys_per_call, open_ms=o, read_ms=r, release_ms=rel,
                        memcpy_ms=round(mc / calls * 1e3, 4), load_ratio=load)


def _present(hs: list[Handle | None], what: str) -> list[Handle]:
    """``hs`` when every handle is there; otherwise the bench stops, saying ``what``."""
    if any(h is None for h in hs):
        raise RuntimeError(f"lw-bench backend: {what}")
    return [h for h in hs if h is not None]


def _layer_views(buf: np.ndarray, count: int, layers: int) -> list[list[np.ndarray]]:
    # Stands in for a KV cache: block of object o in layer l at (o * layers + l).
    return [[buf[(o * layers + layer) * LAYER_BYTES : (o * layers + layer + 1) * LAYER_BYTES] for o in range(count)]
            for layer in range(layers)]


def _layer_get(b: Backend, keys: list[str], layers: int, reps: int) -> tuple[float, float, list[float]]:
    """Best seconds of the per-layer reads, of their memcpy, and [open, all reads, release] (the
    open and release happen once, around the timed reads)."""
    dst = np.zeros(len(keys) * layers * LAYER_BYTES, np.uint8)
    dst[:] = 1
    views = _layer_views(dst, len(keys), layers)
    t0 = time.perf_counter()
    hs = _present(b.open(keys), "layer objects vanished (pool too small?)")
    t_open = time.perf_counter() - t0
    try:

        def go() -> None:
            for layer in range(layers):
                b.read(hs, [layer * LAYER_BYTES] * len(hs), views[layer])

        s, mc = _pair(go, _memcpy_fn(LAYER_BYTES, len(keys) * layers), reps)
        if not np.array_equal(dst, _fill(dst.size)):
            raise RuntimeError("lw-bench backend: read back wrong layer bytes")
    finally:
        t0 = time.perf_counter()
        b.release(hs)
        t_release = time.perf_counter() - t0
    return s, mc, [t_open, s, t_release]


# ----------------------------------------------------------------------------- the cases


def _whole_case(b: Backend, case: Case, n: int, count: int, batch: int, reps: int,
                bar: Any) -> tuple[list[BackendRow], GetBreakdown, list[str]]:
    src = _fill(count * n)
    views = [src[i * n : (i + 1) * n] for i in range(count)]
    sets: list[list[str]] = []

    def put() -> None:
        keys = [f"bench/{case}/{uuid.uuid4().hex}" for _ in range(count)]
        for i in range(0, count, batch):
            hs = _present(b.reserve(keys[i : i + batch], n), f"reserve refused {case} objects (pool full of leased objects?)")
            b.write(hs, [0] * len(hs), views[i : i + batch])
            b.commit(hs)
        sets.append(keys)

    calls = -(-count // batch)
    s_put, mc_put = _pair(put, _memcpy_fn(n, count), reps)
    bar.update()
    keys = sets[-1]
    s_get, mc_get, parts = _whole_get(b, keys, n, batch, reps)
    bar.update()
    rows = [
        _row(case, "put", "same", n, count, n * count, s_put, mc_put, calls),
        _row(case, "get", "same", n, count, n * count, s_get, mc_get, calls),
    ]
    return rows, _breakdown(case, "same", min(batch, count), calls, parts, mc_get), keys


def _layer_case(b: Backend, count: int, layers: int, reps: int,
                bar: Any) -> tuple[list[BackendRow], list[MetadataRow], GetBreakdown, list[str]]:
    n = layers * LAYER_BYTES
    views = _layer_views(_fill(count * n), count, layers)
    meta = {"reserve+commit": float("inf")}
    sets: list[list[str]] = []

    def put() -> float:
        keys = [f"bench/layer/{uuid.uuid4().hex}" for _ in range(count)]
        t0 = time.perf_counter()
        hs = _present(b.reserve(keys, n), "reserve refused layer objects")
        t_res = time.perf_counter() - t0
        t1 = time.perf_counter()
        for layer in range(layers):
            b.write(hs, [layer * LAYER_BYTES] * count, views[layer])
        t_layers = time.perf_counter() - t1
        t2 = time.perf_counter()
        b.commit(hs)
        meta["reserve+commit"] = min(meta["reserve+commit"], t_res + time.perf_counter() - t2)
        sets.append(keys)
        return t_layers

    s_put, mc_put = _pair(put, _memcpy_fn(LAYER_BYTES, count * layers), reps)
    bar.update()
    keys = sets[-1]
    s_get, mc_get, parts = _layer_get(b, keys, layers, reps)

    def open_release() -> None:
        b.release(_present(b.open(keys), "layer objects vanished (pool too small?)"))

    s_open, _ = _pair(open_release, lambda: None, reps)
    bar.update()
    moved = count * n
    rows = [
        _row("layer_16KiB", "put", "same", n, count, moved, s_put, mc_put, layers),
        _row("layer_16KiB", "get", "same", n, count, moved, s_get, mc_get, layers),
    ]
    metadata = [
        MetadataRow(case="layer_16KiB", op="reserve+commit", keys_per_call=count, ms_per_call=round(meta["reserve+commit"] * 1e3, 4)),
        MetadataRow(case="layer_16KiB", op="open+release", keys_per_call=count, ms_per_call=round(s_open * 1e3, 4)),
    ]
    return rows, metadata, _breakdown("layer_16KiB", "same", count, layers, parts, mc_get, s_open), keys


def _child_read(extra: dict, jobs: list[dict], reps: int, batch: int, out: Any, ns: str | None = None) -> None:
    """Runs in a spawned process: attach to the pool by config and read what the parent wrote
    (from network namespace ``ns``, another host, when given)."""
    try:
        if ns is not None:
            netns.setns(ns)
        where: Literal["other", "other-host"] = "other" if ns is None else "other-host"
        b = open_backend(parse_config(extra))
        rows, parts = [], []
        try:
            for j in jobs:
                count = len(j["keys"])
                if j["case"] == "layer_16KiB":
                    s, mc, t = _layer_get(b, j["keys"], j["layers"], reps)
                    n, calls, per_call = j["layers"] * LAYER_BYTES, j["layers"], count
                else:
                    n = j["object_bytes"]
                    s, mc, t = _whole_get(b, j["keys"], n, batch, reps)
                    calls, per_call = -(-count // batch), min(batch, count)
                rows.append(_row(j["case"], "get", where, n, count, n * count, s, mc, calls))
                parts.append(_breakdown(j["case"], where, per_call, calls, t, mc))
        finally:
            b.close()
        out.put(("ok", (rows, parts)))
    except BaseException as e:  # report, never leave the parent waiting
        out.put(("error", f"{type(e).__name__}: {e}"))


def _cross_process(extra: dict, jobs: list[dict], reps: int, batch: int,
                   ns: str | None = None) -> tuple[list[BackendRow], list[GetBreakdown]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_read, args=(extra, jobs, reps, batch, q, ns), daemon=True)
    p.start()
    try:
        status, payload = q.get(timeout=_CHILD_TIMEOUT_S)
    except queue.Empty:
        raise RuntimeError(f"lw-bench backend: the reading process gave no answer within {_CHILD_TIMEOUT_S}s") from None
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(f"lw-bench backend: the reading process failed: {payload}")
    return payload


# ----------------------------------------------------------------------------- backends


def _open_store(args: argparse.Namespace, capacity: int) -> AbstractContextManager[tuple[Backend, dict]]:
    # The backend's plugin makes a throwaway pool (embedded: a temporary directory; memcache, from
    # lw-memcache: a local MetaService and holder) and says which config selects it.
    # --host-tcp-netns: the pool on this (already entered) host's address (memcache: over host_tcp).
    kw: dict[str, Any] = {}
    if args.host_tcp_netns:
        kw = {"host": netns.address(args.host_tcp_netns[0]),
              **({"protocol": "host_tcp"} if args.backend == "memcache" else {})}
    return bench_store.bench_store("backend", args.backend, capacity, args.path, args.keys, **kw)


def run(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    reps = args.reps or (2 if quick else 5)
    layers = args.layers or (4 if quick else 32)
    batch = args.batch
    for name, v in (("--reps", reps), ("--batch", batch), ("--layers", layers)):
        if v < 1:
            raise SystemExit(f"lw-bench backend: {name}={v} must be >= 1")
    n64, n4m = (64, 4) if quick else (256, 8)
    # Each repetition writes fresh keys (write-once), so later ones evict earlier ones: puts are
    # measured on a full pool, as in steady state. Each case's last set stays leased for the reads.
    if args.backend == "embedded" and n64 + n4m + batch > LEASES_PER_PROCESS:
        # Each case's last set stays leased for the reads: past the pool's leases per process an
        # open answers misses, which would read as objects evicted.
        raise SystemExit(f"lw-bench backend: --batch={batch}: the embedded pool holds at most {LEASES_PER_PROCESS} "
                         f"leases per process and this bench holds {n64 + n4m} + the batch at once; "
                         f"use --batch <= {LEASES_PER_PROCESS - n64 - n4m}")
    data = n64 * 64 * KiB + n4m * 4 * MiB + batch * layers * LAYER_BYTES
    capacity = max(8 * MiB, 3 * data)

    args.keys = bench_store.parse_keys("backend", getattr(args, "backend_key", None))
    bench_store.check_keys("backend", args.backend, args.keys)
    hosts = None
    if args.host_tcp_netns:
        if args.backend not in ("memcache", "mooncake"):
            raise SystemExit(f"lw-bench backend --host-tcp-netns needs --backend memcache or mooncake (got {args.backend!r})")
        hosts = netns.parse_pair(args.host_tcp_netns) if isinstance(args.host_tcp_netns, str) else args.host_tcp_netns
        args.host_tcp_netns = hosts
    t0 = time.perf_counter()
    with netns.entered(hosts[0] if hosts else None), _open_store(args, capacity) as (b, extra):
        setup = time.perf_counter() - t0
        cross = not args.no_cross_process
        bar = tqdm(total=6 + cross, desc="lw-bench backend", file=sys.stderr, leave=False)
        results: list[BackendRow] = []
        breakdown: list[GetBreakdown] = []
        jobs: list[dict] = []
        held = []
        whole: tuple[tuple[Case, int, int], ...] = (("64KiB", 64 * KiB, n64), ("4MiB", 4 * MiB, n4m))
        for case, n, count in whole:
            rows, parts, keys = _whole_case(b, case, n, count, batch, reps, bar)
            held += b.open(keys)
            results += rows
            breakdown.append(parts)
            jobs.append({"case": case, "object_bytes": n, "keys": keys})
        rows, metadata, parts, keys = _layer_case(b, batch, layers, reps, bar)
        results += rows
        breakdown.append(parts)
        jobs.append({"case": "layer_16KiB", "layers": layers, "keys": keys})
        bar.update()
        if cross:
            rows, other = _cross_process(extra, jobs, reps, batch, hosts[1] if hosts else None)
            results += rows
            breakdown += other
            bar.update()
        b.release([h for h in held if h is not None])
        bar.close()
        stats = b.stats()
        name = b.name
    res = BackendBenchResult(backend=name, backend_keys=args.keys, quick=quick, hosts=list(hosts) if hosts else None,
                             setup_s=round(setup, 3), results=results, metadata=metadata, stats=stats,
                             breakdown=breakdown)
    out: dict[str, Any] = msgspec.to_builtins(res)
    if not getattr(args, "json", False):
        _print_table(out)
    return out


def _print_table(out: dict) -> None:
    keys = "".join(f", {k}={v!r}" for k, v in out["backend_keys"].items())
    print(f"lw-bench backend: {out['backend']}{keys} (pool set-up {out['setup_s']} s; best of repetitions)")
    head = f"{'case':<12} {'op':<4} {'process':<10} {'object':>9} {'objs':>5} {'GB/s':>7} {'memcpy':>7} {'ratio':>6} {'ms/call':>8}"
    print(head)
    print("-" * len(head))
    for r in out["results"]:
        obj = f"{r['object_bytes'] // KiB} KiB"
        print(
            f"{r['case']:<12} {r['op']:<4} {r['process']:<10} {obj:>9} {r['objects']:>5} "
            f"{r['gbps']:>7.2f} {r['memcpy_gbps']:>7.2f} {r['ratio']:>6.2f} {r['ms_per_call']:>8.3f}"
        )
    for m in out["metadata"]:
        print(f"{m['case']:<12} {m['op']:<15} {m['keys_per_call']} keys: {m['ms_per_call']:.3f} ms/call")
    print("get breakdown, ms per call (open and release: once per load in layer_16KiB):")
    for g in out["breakdown"]:
        print(f"  {g['case']:<12} {g['process']:<10} {g['keys_per_call']:>3} keys: open {g['open_ms']:.3f}  read {g['read_ms']:.3f}  "
              f"release {g['release_ms']:.3f}  | memcpy {g['memcpy_ms']:.3f}"
              + ("" if g.get("load_ratio") is None else f"  | whole load, open included: ratio {g['load_ratio']:.3f}"))
    s = out["stats"]
    print(f"pool: {s.get('objects')} objects, {s.get('evictions', 0)} evictions")
