"""``lw-bench serve --disk-dir DIR``: the disk-hit row of the embedded pool's disk tier.

Two more engines, both on the embedded backend with the tier in a fresh directory under ``DIR``
(put it on the disk to measure, not on tmpfs):

* ``disk/save`` -- a DRAM pool of about 1.25 longest prompts, prefix cache off: it computes and
  saves every prefix like ``save``, then *flush* prompts of the longest length, more than the DRAM
  pool holds, which push every measured prefix out of DRAM; the tier writes what DRAM evicts to disk. The engine closes
  the pool before it exits, and the tier writes what it still has queued.
* ``disk/hit`` -- a **new, empty** DRAM pool (a fresh directory for every engine) over the same
  tier, prefix cache on: a first request can only hit the disk. Before each such engine the tier's
  files are dropped from the page cache (fsync + ``posix_fadvise(DONTNEED)``), so the hit reads
  the disk, and the same directory's sequential read is measured: a file of the longest hit's size
  is written, synced, dropped from the page cache and read once in 4 MiB reads.

Figures by prefix length: disk-hit TTFT / DRAM-hit TTFT (the embedded ``layerwise_d<h>`` engine)
and / recompute; the tier's read bandwidth = bytes read per hit / (first - second request TTFT of
the same prefix in the same engine, i.e. the load's cost beyond vLLM's own prefix cache), and
that over the sequential read (goal >= 0.8). Checked: every disk hit loaded the whole prefix
(as every pool hit is), and the engine's ``disk_hits`` counter (lw_vllm.metrics) is positive.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import uuid
from typing import Any

SAVE, HIT = "disk/save", "disk/hit"
TARGET = 0.8  # tier read bandwidth / sequential read
_READ = 4 << 20


def configure(cfg: dict[str, Any], disk_dir: str, *, direct_io: bool = False) -> None:
    """Add the tier's directory, sizes and read mode (``direct_io``) to ``cfg``."""
    if not os.path.isdir(disk_dir):
        raise SystemExit(f"lw-bench serve: --disk-dir={disk_dir!r} is not a directory")
    kv, lmax = cfg["kv_bytes_per_token"], max(cfg["lengths"])
    cfg["disk_dir"] = os.path.join(os.path.abspath(disk_dir), f"lw-bench-serve-tier-{uuid.uuid4().hex[:8]}")
    cfg["disk_dram_bytes"] = max(1 << 20, (lmax + cfg["block_size"]) * kv * 5 // 4)
    saved = (cfg["reps"] + 1) * sum(cfg["lengths"]) + 3 * lmax
    cfg["disk_capacity_bytes"] = max(64 << 20, 2 * saved * kv)
    cfg["disk_direct_io"] = direct_io


def modes(cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None, bool]]:
    """``(name, extra config, vLLM prefix cache on)``; ``disk/hit``'s DRAM path is set per engine (``fresh_dram``)."""
    tier = {"embedded_disk_path": cfg["disk_dir"], "embedded_disk_capacity_bytes": cfg["disk_capacity_bytes"],
            "embedded_disk_direct_io": bool(cfg.get("disk_direct_io")), "use_layerwise": True}
    return [
        (SAVE, {**tier, "embedded_path": cfg["pool_path"] + "-disk-save",
                "embedded_capacity_bytes": cfg["disk_dram_bytes"]}, False),
        (HIT, {**tier, "embedded_path": "", "embedded_capacity_bytes": cfg["pool_capacity_bytes"],
               "layerwise_prefetch_layers": cfg["headline_depth"]}, True),
    ]


def flush_count(cfg: dict[str, Any]) -> int:
    """How many prompts of the longest length disk/save runs after the measured ones: together
    more than its DRAM pool holds, so they evict every measured chunk to disk."""
    per = max(cfg["lengths"]) * cfg["kv_bytes_per_token"]
    return int(cfg["disk_dram_bytes"] // per + 1)


def fresh_dram(job: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """``job`` with a new, empty DRAM pool directory (removed by ``cleanup``)."""
    path = f"{cfg['pool_path']}-disk-hit-{uuid.uuid4().hex[:8]}"
    return {**job, "extra": {**job["extra"], "embedded_path": path}}


def drop_cache(path: str) -> int:
    """Sync every file under ``path`` and drop it from the page cache; returns the bytes dropped."""
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:  # evicted meanwhile
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def sequential_read_gbps(directory: str, nbytes: int) -> float:
    """Write ``nbytes`` to a file in ``directory``, sync it, drop it from the page cache and time
    one sequential read of it (GB/s)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"seq-read-{uuid.uuid4().hex[:8]}.bin")
    block = os.urandom(_READ)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for off in range(0, nbytes, _READ):
                os.write(fd, block[: min(_READ, nbytes - off)])
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        buf = bytearray(_READ)
        fd = os.open(path, os.O_RDONLY)
        try:
            t, got = time.perf_counter(), 0
            while n := os.readv(fd, [buf]):
                got += n
            dt = time.perf_counter() - t
        finally:
            os.close(fd)
        return got / dt / 1e9
    finally:
        os.unlink(path)


def cleanup(cfg: dict[str, Any]) -> None:
    if cfg.get("disk_dir"):
        shutil.rmtree(cfg["disk_dir"], ignore_errors=True)
    base = os.path.dirname(cfg["pool_path"])
    stem = os.path.basename(cfg["pool_path"]) + "-disk-"
    for n in os.listdir(base) if os.path.isdir(base) else ():
        if n.startswith(stem):
            shutil.rmtree(os.path.join(base, n), ignore_errors=True)


def rows(cfg: dict[str, Any], r: dict[str, Any], dram_hit: str, seq_gbps: list[float],
         counters: list[dict[str, float]]) -> dict[str, Any]:
    """The disk row from the summary ``r`` (``ttft_s``, ``pool_load_s``, ``pool_loaded_bytes``),
    the sequential reads and the ``disk/hit`` engines' counters."""
    lengths = [str(L) for L in cfg["lengths"]]
    hit, dram, rec = r["ttft_s"][HIT], r["ttft_s"][dram_hit], r["ttft_s"]["recompute"]
    seq = statistics.median(seq_gbps) if seq_gbps else None

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    read = {}
    for L in lengths:
        load, nbytes = r["pool_load_s"][HIT][L], r["pool_loaded_bytes"][HIT][L]
        read[L] = nbytes / load / 1e9 if nbytes and load is not None and load > 0 else None
    hits = [int(c.get("disk_hits", 0)) for c in counters]
    return {
        "path": cfg["disk_dir"],
        "dram_bytes": cfg["disk_dram_bytes"],
        "direct_io": bool(cfg.get("disk_direct_io")),
        "hit_ttft_s": hit,
        "vs_dram_hit": {L: div(hit[L], dram[L]) for L in lengths},
        "vs_recompute": {L: div(hit[L], rec[L]) for L in lengths},
        "read_gbps": read,
        "seq_read_gbps": seq_gbps,
        "read_vs_seq": {L: div(read[L], seq) for L in lengths},
        "disk_hits": hits,
        "disk_read_bytes": [int(c.get("disk_read_bytes", 0)) for c in counters],
        "expected_hits": (cfg["reps"] + 1) * sum(cfg["lengths"]) // cfg["block_size"],
        "disk_hits_ok": bool(hits) and all(h > 0 for h in hits),
        "target": TARGET,
    }


def print_rows(d: dict[str, Any], lengths: list[str]) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"
    reads = "direct I/O" if d.get("direct_io") else "buffered reads"
    print(f"disk tier ({d['path']}; saver's DRAM {d['dram_bytes'] >> 20} MiB; {reads}): disk hit from a new, empty DRAM pool")
    print("  prefix  disk-hit ms  / DRAM hit  / recompute  tier GB/s  / seq read")
    for L in lengths:
        t = d["hit_ttft_s"][L]
        print(f"  {L:>6} {'-' if t is None else f'{t * 1e3:.1f}':>12} {f(d['vs_dram_hit'][L]):>11} "
              f"{f(d['vs_recompute'][L]):>12} {f(d['read_gbps'][L]):>10} {f(d['read_vs_seq'][L]):>10}")
    seq = ", ".join(f"{x:.3f}" for x in d["seq_read_gbps"])
    print(f"  sequential read of the same directory: {seq} GB/s (one per disk/hit engine); goal tier/seq >= {d['target']}")
    print(f"  disk_hits per disk/hit engine {d['disk_hits']} (chunks its first requests loaded: {d['expected_hits']}), "
          f"disk_read_bytes {d['disk_read_bytes']}, disk_hits_ok={d['disk_hits_ok']}")
