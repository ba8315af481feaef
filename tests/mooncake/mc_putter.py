"""A writer process for the putter-killed test: commits objects ``p0, p1, ...`` of known bytes in
a loop, printing ``committed N`` after each, until killed. Run inside a namespace host."""

from __future__ import annotations

import sys

import numpy as np


def content(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> None:
    from lw_mooncake.backend import MooncakeBackend

    master, host, nbytes, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), 4
    b = MooncakeBackend(master, local_hostname=host, staging_size=max(nbytes, 1 << 20))
    per = nbytes // layers
    for i in range(1_000_000):
        data = content(i, nbytes)
        (h,) = b.reserve([f"p{i}"], nbytes)
        for layer in range(layers):  # layer by layer, as the pipeline writes
            b.write([h], [layer * per], [data[layer * per : (layer + 1) * per]])
        b.commit([h])
        print(f"committed {i}", flush=True)


if __name__ == "__main__":
    main()
