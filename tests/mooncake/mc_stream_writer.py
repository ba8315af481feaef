"""A streaming writer process for the writer-killed test: reserves ``key``, writes and publishes
its layer 0 (``layers`` layers of ``per`` bytes, bytes from ``content``), prints ``published``,
then waits to be killed without committing. Run inside a namespace host."""

from __future__ import annotations

import sys
import time

import numpy as np


def content(nbytes: int) -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> None:
    from lw_core.backend import publish_layers
    from lw_mooncake.backend import MooncakeBackend

    master, host, key, layers, per = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    b = MooncakeBackend(master, local_hostname=host, streaming=True)
    data = content(layers * per)
    (h,) = b.reserve([key], layers * per)
    b.write([h], [0], [data[:per]])
    publish_layers(b, [h], 0, per)
    print("published", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
