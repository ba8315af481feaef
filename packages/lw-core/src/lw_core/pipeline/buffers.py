"""Host buffers: page-aligned uint8 arrays for KV stand-ins and staging."""

from __future__ import annotations

import numpy as np

PAGE = 4096


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """Uninitialised uint8 buffer whose first byte is ``align``-aligned.

    Copies between buffers whose addresses differ by a few bytes mod 4 KiB run up to 2.5x slower on
    this machine kind (embedded-store-facts.md); page-aligning KV and staging keeps them congruent.
    """
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]
