"""A memcache client process driven by tests: one JSON request per stdin line, one JSON reply per
stdout line. Runs a real ``MemcacheBackend`` (via ``open_backend``), so tests can put a writer and
a reader in different processes and kill either at any point.

Object bytes are a pure function of (key, layer), so the test process knows what every read must
return without shipping data around.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import traceback

import numpy as np


def layer_bytes(key: str, layer: int, n: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(f"{key}/{layer}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def main() -> None:
    from lw_core.backend import BackendError
    from lw_core.backends.registry import open_backend
    from lw_core.config import parse_config

    extra = json.loads(sys.argv[1])
    # Library log lines go to stdout too: replies get a prefix the driver looks for.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(reply_fd, "w", buffering=1)

    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    backend = open_backend(parse_config(extra), **kwargs)
    handles: dict[str, object] = {}
    opened: dict[str, object] = {}

    def reply(**kw: object) -> None:
        out.write("@@" + json.dumps(kw) + "\n")

    reply(ok=True, pid=os.getpid())
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "lookup":
                reply(ok=True, value=backend.lookup(req["keys"]))
            elif op == "reserve":
                hs = backend.reserve(req["keys"], req["layers"] * req["layer_nbytes"])
                for k, h in zip(req["keys"], hs):
                    if h is not None:
                        handles[k] = h
                reply(ok=True, value=[h is not None for h in hs])
            elif op == "write_layers":  # one batched write per layer, like the pipeline
                keys, n = req["keys"], req["layer_nbytes"]
                for layer in req["layers"]:
                    srcs = [layer_bytes(k, layer, n) for k in keys]
                    backend.write([handles[k] for k in keys], [layer * n] * len(keys), srcs)
                reply(ok=True)
            elif op == "commit":
                backend.commit([handles.pop(k) for k in req["keys"]])
                reply(ok=True)
            elif op == "abort":
                backend.abort([handles.pop(k) for k in req["keys"]])
                reply(ok=True)
            elif op == "open":
                hs = backend.open(req["keys"])
                for k, h in zip(req["keys"], hs):
                    if h is not None:
                        opened[k] = h
                reply(ok=True, value=[h is not None for h in hs])
            elif op == "read":  # ranges [(key, offset, nbytes)] in one batched read
                dsts = [bytearray(n) for _, _, n in req["ranges"]]
                backend.read([opened[k] for k, _, _ in req["ranges"]], [o for _, o, _ in req["ranges"]], dsts)
                reply(ok=True, value=[base64.b64encode(d).decode() for d in dsts])
            elif op == "release":
                backend.release([opened.pop(k) for k in req["keys"]])
                reply(ok=True)
            elif op == "remove":  # as the MetaService's eviction does
                reply(ok=True, value=backend.client.store.remove_batch(req["keys"]))
            elif op == "stats":
                reply(ok=True, value=backend.stats())
            elif op == "close":
                backend.close()
                reply(ok=True)
                return
            else:
                reply(ok=False, error=f"unknown op {op}", type="ValueError")
        except BackendError as e:
            reply(ok=False, error=str(e), type=type(e).__name__)
        except Exception as e:  # noqa: BLE001 - report anything to the test
            reply(ok=False, error=f"{e}\n{traceback.format_exc()}", type=type(e).__name__)
    backend.close()


if __name__ == "__main__":
    main()
