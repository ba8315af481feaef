"""Profile a disk-tier hit without an engine: demote N objects into a tier directory, drop them
from the page cache, then open them through the embedded pool's tiered reads (one ``open`` call,
as the pipeline does) and read each layer's range of every object (``view``, as the pipeline's
zero-copy path does) and the CPU time it took; compare with one sequential read of the same bytes in the same directory.
``--rounds N`` repeats the hit N times in the same process (the files dropped from the page cache
each time): the first hit faults in fresh payload buffers, later ones reuse the released ones.

    uv run --no-sync python scripts/disk_tier_read_probe.py --dir /var/tmp --objects 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from lw_bench.serve.disk import drop_cache, sequential_read_gbps
from lw_core.backends.embedded import disk_tier
from lw_core.backends.embedded.disk_tier import DiskTier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--objects", type=int, default=256)
    ap.add_argument("--object-bytes", type=int, default=768 << 10)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--readers", type=int, default=disk_tier.READERS)
    ap.add_argument("--warm", action="store_true", help="leave the files in the page cache (the CPU's share)")
    ap.add_argument("--rounds", type=int, default=1, help="hits in the same process (later ones recycle buffers)")
    ap.add_argument("--direct-io", action="store_true", help="read with direct I/O (embedded_disk_direct_io)")
    args = ap.parse_args()
    disk_tier.READERS = args.readers
    n, size, nl = args.objects, args.object_bytes, args.layers
    root = tempfile.mkdtemp(prefix="lw-disk-probe-", dir=args.dir)
    path = os.path.join(root, "tier")
    try:
        tier = DiskTier(path, 4 * n * (size + 4096), queue_bytes=n * size + 1)
        payload = os.urandom(size)
        keys = [f"probe-{i}" for i in range(n)]
        for k in keys:
            tier.offer(k.encode(), memoryview(payload))
        assert tier.flush(600)
        tier.close()
        tier = DiskTier(path, 4 * n * (size + 4096), queue_bytes=1, direct_io=args.direct_io)
        per = size // nl
        times = []
        for _ in range(args.rounds):
            if not args.warm:
                drop_cache(path)
            t0, c0 = time.perf_counter(), time.process_time()
            hs = tier.open_many(keys, [k.encode() for k in keys])
            t1 = time.perf_counter()
            assert all(h is not None for h in hs)
            for layer in range(nl):
                for h in hs:
                    assert h is not None
                    tier.view(h, layer * per, per)
            t2 = time.perf_counter()
            for h in hs:
                assert h is not None
                tier.release(h)
            times.append((t1 - t0, t2 - t1, t2 - t0, time.process_time() - c0))
        tier.close()
        seq = sequential_read_gbps(root, n * size)
        for i, (t_open, t_layers, t_all, cpu) in enumerate(times):
            gbps = n * size / t_all / 1e9
            print(f"objects {n} x {size} B, {nl} layers, {args.readers} readers, hit {i + 1}: open {t_open:.3f} s, layer reads {t_layers:.3f} s, CPU {cpu:.3f} s, "
                  f"tier read {gbps:.3f} GB/s, sequential {seq:.3f} GB/s, ratio {gbps / seq:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
