"""Host memory the backend hands to Mooncake: flat byte views of callers' buffers, registered
staging that a late (timed-out) call cannot corrupt, and the buffers such calls still hold."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from lw_core.backend import BackendUnavailable
from lw_mooncake.calls import CallTimedOut, Deadlines
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


class LateBuffers:
    """Registered buffers that a failed call may still use. A buffer given to a call past its
    deadline (``CallTimedOut``) stays referenced and registered until that call returns; then
    ``prune`` unregisters it and lets it go. A buffer whose unregistration fails (or that must
    stay registered, ``keep_forever``) stays referenced for the client's life, as Mooncake may
    still write it. So only calls still stuck in the store (at most its worker threads) and
    failed unregistrations hold memory, however many calls time out."""

    def __init__(self, store: Any, calls: Deadlines) -> None:
        self.store, self.calls = store, calls
        self._lock = threading.Lock()
        self._late: list[tuple[np.ndarray, Future[Any] | None]] = []
        self._stuck: list[np.ndarray] = []

    def keep(self, buf: np.ndarray, error: BaseException) -> None:
        """``buf`` (registered) was given to the call that raised ``error``."""
        pending = error.pending if isinstance(error, CallTimedOut) else None
        with self._lock:
            self._late.append((buf, pending))

    def keep_forever(self, buf: np.ndarray) -> None:
        with self._lock:
            self._stuck.append(buf)

    def prune(self) -> None:
        """Unregister and drop each buffer whose call has returned (each under the deadline)."""
        with self._lock:
            done = [b for b, f in self._late if f is None or f.done()]
            self._late = [(b, f) for b, f in self._late if not (f is None or f.done())]
        for buf in done:
            try:
                ok = self.calls.call("unregister_buffer (late)", self.store.unregister_buffer, int(buf.ctypes.data)) == 0
            except BackendUnavailable:
                ok = False
            if not ok:
                self.keep_forever(buf)

    def held(self) -> list[np.ndarray]:
        """The buffers held: those of calls not known to have returned, then those kept for good."""
        with self._lock:
            return [b for b, _ in self._late] + self._stuck

    def __len__(self) -> int:
        with self._lock:
            return len(self._late) + len(self._stuck)


class Staging:
    """A registered host buffer for one direction (puts or gets), used by one batch at a time.

    ``get()`` gives the buffer under the lock; after a failed call, ``retire(error)`` hands it to
    ``late`` (kept until a late call returns) and the next ``get`` registers a new one.
    """

    def __init__(self, store: Any, nbytes: int, calls: Deadlines, what: str) -> None:
        self.store, self.nbytes, self.calls, self.what = store, nbytes, calls, what
        self.lock = threading.Lock()
        self._buf: np.ndarray | None = None
        self.late = LateBuffers(store, calls)

    def get(self) -> np.ndarray:
        """The buffer, registering it first if needed; call with ``lock`` held."""
        self.late.prune()
        if self._buf is None:
            buf = np.empty(self.nbytes, np.uint8)
            try:
                rc = self.calls.call(f"register_buffer ({self.what} staging)", self.store.register_buffer,
                                     int(buf.ctypes.data), self.nbytes)
            except BackendUnavailable as e:
                self.late.keep(buf, e)  # a late registration: unregistered once it returns
                raise
            if rc != 0:
                raise to_error(rc, f"register_buffer of {self.nbytes} bytes ({self.what} staging)")
            self._buf = buf
        return self._buf

    def retire(self, error: BaseException) -> None:
        """The call that used the buffer raised ``error``: hand the buffer to ``late``."""
        if self._buf is not None:
            self.late.keep(self._buf, error)
            self._buf = None
