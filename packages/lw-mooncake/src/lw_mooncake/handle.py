"""The handle of one pool object: reserved (its local buffer) or opened for reading."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from lw_core.backend import BackendError


@dataclass(eq=False, slots=True)
class MooncakeHandle:
    key: str
    nbytes: int
    buf: np.ndarray | None = field(default=None, repr=False)  # the local object while reserved
    data: np.ndarray | None = field(default=None, repr=False)  # a read handle's fetched object ("whole")
    committed: bool = False  # its put succeeded: committing it again is a no-op
    failed: BackendError | None = None  # its put failed with this: committing it again raises it again
