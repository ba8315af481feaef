"""Host memory the backend hands to Mooncake: flat byte views of callers' buffers, and registered
staging that a late (timed-out) call cannot corrupt."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from lw_mooncake.calls import Deadlines
from lw_mooncake.errors import to_error


def byte_view(buf: Any, *, writable: bool, what: str) -> np.ndarray:
    """``buf`` (numpy array, memoryview, bytearray ...) as a flat uint8 array, without copying."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what}: array must be C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: needs a contiguous buffer (memoryview, bytearray, numpy array): {e}") from e
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: destination buffer is read-only")
    return arr


class Staging:
    """A registered host buffer for one direction (puts or gets), used by one batch at a time.

    ``lease()`` gives the buffer under the lock; after a timed-out call, ``retire()`` drops it
    (kept referenced, as the late call may still touch it) and the next lease registers a new one.
    """

    def __init__(self, store: Any, nbytes: int, calls: Deadlines, what: str) -> None:
        self.store, self.nbytes, self.calls, self.what = store, nbytes, calls, what
        self.lock = threading.Lock()
        self._buf: np.ndarray | None = None
        self._retired: list[np.ndarray] = []

    def get(self) -> np.ndarray:
        """The buffer, registering it first if needed; call with ``lock`` held."""
        if self._buf is None:
            buf = np.empty(self.nbytes, np.uint8)
            rc = self.calls.call(f"register_buffer ({self.what} staging)", self.store.register_buffer,
                                 int(buf.ctypes.data), self.nbytes)
            if rc != 0:
                raise to_error(rc, f"register_buffer of {self.nbytes} bytes ({self.what} staging)")
            self._buf = buf
        return self._buf

    def retire(self) -> None:
        if self._buf is not None:
            self._retired.append(self._buf)
            self._buf = None
