"""How long a layerwise save on Mooncake makes a step wait after its last layer, with put sessions
(each layer's ranged put runs in the pipeline's save workers, during the next layers' compute)
and with whole-object puts at commit.

Run as root inside a network namespace (Mooncake's clients listen on every address), e.g.
``ip netns add lwmx; ip netns exec lwmx ip link set lo up; ip netns exec lwmx uv run --no-sync
python scripts/mooncake_save_overlap.py``. Starts a master and a holder on 127.0.0.1 (lw_mooncake.local).
Each save: ``start_save``, then per layer a sleep of ``--compute-ms`` (the layer's compute) and
``save_layer``, then ``finish_save``; reported: medians of the time in ``finish_save`` (the tail
after the last layer) and of the whole save, and that a reader gets the saved bytes back.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import numpy as np

from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ObjectLayout, ReqSave
from lw_mooncake.backend import MooncakeBackend
from lw_mooncake.local import LocalMooncake


def run(a: argparse.Namespace, sessions: bool, address: str) -> dict[str, float]:
    layout = ObjectLayout(layer_nbytes=(a.block_bytes,) * a.layers)
    src = HostCopier.allocate(a.layers, a.blocks, a.block_bytes, fill=None)
    for i, arr in enumerate(src.kv):
        arr[:] = np.random.default_rng(i).integers(0, 256, arr.shape, dtype=np.uint8)
    tails, totals = [], []
    with MooncakeBackend(address, local_hostname="127.0.0.1", put_sessions=sessions) as b:
        assert (b.writer.sessions is not None) == sessions
        for _ in range(a.reps):
            keys = [f"ov/{uuid.uuid4().hex}" for _ in range(a.blocks)]
            with LayerPipeline(b, src, layout, save_timeout_s=60.0) as pipe:
                t0 = time.perf_counter()
                pipe.start_save([ReqSave("r", keys, list(range(a.blocks)))])
                for layer in range(a.layers):
                    time.sleep(a.compute_ms / 1e3)
                    pipe.save_layer(layer)
                t1 = time.perf_counter()
                res = pipe.finish_save()
                t2 = time.perf_counter()
            assert sorted(res.committed_keys) == sorted(keys), res.errors
            tails.append(t2 - t1)
            totals.append(t2 - t0)
            (h,) = b.open([keys[-1]])
            out = bytearray(a.block_bytes)
            b.read([h], [layout.offsets[a.layers - 1]], [out])
            b.release([h])
            assert bytes(out) == src.kv[a.layers - 1][a.blocks - 1].tobytes()
    return {"finish_save_ms": round(1e3 * statistics.median(tails), 2), "save_ms": round(1e3 * statistics.median(totals), 2),
            "compute_ms": a.layers * a.compute_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--block-bytes", type=int, default=16384)
    p.add_argument("--compute-ms", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--port", type=int, default=50261)
    a = p.parse_args()
    with LocalMooncake(host="127.0.0.1", port=a.port, metrics_port=a.port + 2, segment_size=512 << 20) as mc:
        for sessions in (False, True):
            print("put sessions" if sessions else "whole puts", run(a, sessions, mc.address), flush=True)


if __name__ == "__main__":
    main()
