"""A recording stand-in for ``lw_vllm.device.device_streams.TorchDeviceOps`` over CPU tensors.

Copies happen at once (so data checks work), but every stream/event call is logged in order, the
current stream is per thread as in torch, and events complete only when the test says so
(``auto_complete=False``), so the device path's ordering rules can be checked without a device.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Sequence

import torch


class FakeStream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, n: int, stream: str, done: bool):
        self.n, self.stream, self.done = n, stream, done

    def __repr__(self) -> str:
        return f"<event {self.n} on {self.stream}{' done' if self.done else ''}>"


class FakeOps:
    device = torch.device("cpu")

    def __init__(self, log: list | None = None, *, auto_complete: bool = True, layers: Sequence[torch.Tensor] = ()):
        self.log = log if log is not None else []
        self.auto_complete = auto_complete
        self.compute = FakeStream("compute")
        self._n = itertools.count(1)
        self._cur = threading.local()
        self._lock = threading.Lock()
        self.events: list[FakeEvent] = []
        self.layer_of = {t.data_ptr(): i for i, t in enumerate(layers)}
        self.pinned_ptrs: list[int] = []

    def _add(self, entry: tuple) -> None:
        with self._lock:
            self.log.append(entry)

    def new_stream(self) -> FakeStream:
        return FakeStream(f"side{next(self._n)}")

    def current_stream(self) -> FakeStream:
        return getattr(self._cur, "stream", None) or self.compute

    @contextlib.contextmanager
    def on(self, stream: FakeStream):
        prev = getattr(self._cur, "stream", None)
        self._cur.stream = stream
        try:
            yield stream
        finally:
            self._cur.stream = prev

    def record(self, stream: FakeStream) -> FakeEvent:
        ev = FakeEvent(next(self._n), stream.name, self.auto_complete)
        with self._lock:
            self.events.append(ev)
        self._add(("record", stream.name, ev))
        return ev

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self._add(("wait", stream.name, event))

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def complete_all(self) -> None:
        with self._lock:
            for ev in self.events:
                ev.done = True

    def pinned(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_ptrs.append(t.data_ptr())
        self._add(("pinned", t.data_ptr(), nbytes))
        return t

    def _layer(self, layer: torch.Tensor) -> int:
        return self.layer_of.get(layer.data_ptr(), -1)

    def h2d(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        s = self.current_stream().name
        self._add(("h2d", s, self._layer(layer), list(block_ids), host.data_ptr(), host.numpy().tobytes()))
        layer.index_copy_(1, torch.tensor(list(block_ids)), host.transpose(0, 1))

    def d2h(self, layer: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        s = self.current_stream().name
        self._add(("d2h", s, self._layer(layer), list(block_ids), host.data_ptr()))
        host.copy_(layer.index_select(1, torch.tensor(list(block_ids))).transpose(0, 1))


def entries(log: list, kind: str) -> list[tuple[int, tuple]]:
    """(position, entry) of every ``kind`` entry in ``log``."""
    return [(i, e) for i, e in enumerate(log) if e[0] == kind]


def position(log: list, entry: tuple) -> int:
    for i, e in enumerate(log):
        if e == entry:
            return i
    raise AssertionError(f"{entry} is not in the log")
