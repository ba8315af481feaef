"""A backend proxy that records, for every release / commit / abort / intact (or table_intact) call, whether the
device copies enqueued so far had all completed at that moment (``copies_done``, a callable the
test gives: the fake ops' events, or a real device's)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

RECORDED = ("release", "commit", "abort", "intact", "table_intact")


class Recording:
    def __init__(self, inner: Any, copies_done: Callable[[], bool]):
        self.inner = inner
        self.name = inner.name
        self.copies_done = copies_done
        self.calls: list[tuple[str, int, bool]] = []  # (method, handles, every copy done then)
        self.called = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in RECORDED:
            return attr

        def recorded(handles: Any, *a: Any) -> Any:
            done = self.copies_done()
            out = attr(handles, *a)
            with self.called:  # table_intact(table, rows) is intact of the handles at rows
                self.calls.append(("intact", len(a[0]), done) if name == "table_intact" else (name, len(handles), done))
                self.called.notify_all()
            return out

        return recorded

    def wait_for(self, name: str, timeout_s: float = 10.0) -> list[tuple[str, int, bool]]:
        with self.called:
            self.called.wait_for(lambda: any(c[0] == name for c in self.calls), timeout_s)
            return [c for c in self.calls if c[0] == name]


class ViewsOnly:
    """The backend without ``view_addresses``: direct copies then take its ``view`` buffers."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:
        if name == "view_addresses":
            raise AttributeError(name)
        return getattr(self.inner, name)
