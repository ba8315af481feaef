"""Collapse repeated log lines: under a flood (a client storm, a backend flapping) the same message
is logged once per window, and the next one after the window says how many were suppressed.

Messages are keyed by logger, level and format string (not the arguments), so "taken out: <peer>"
lines for a thousand peers or one traceback per bad connection count as one message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

_MAX_KEYS = 4096


class RepeatFilter(logging.Filter):
    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window = window
        self._clock = clock
        self._seen: dict[tuple, list] = {}  # key -> [window start, suppressed count]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.window <= 0:
            return True
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        key = (record.name, record.levelno, str(record.msg), exc)
        now = self._clock()
        st = self._seen.get(key)
        if st is not None and now - st[0] < self.window:
            st[1] += 1
            return False
        if len(self._seen) >= _MAX_KEYS:  # drop windows that are over; a flood of new keys cannot grow this
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window}
        self._seen[key] = [now, 0]
        if st is not None and st[1]:
            record.msg = f"{record.msg} [and {st[1]} more like this in the previous {self.window:g} s, suppressed]"
        return True


def install(window: float) -> RepeatFilter:
    """Put one filter on every handler of the root logger (handlers see propagated records; logger
    filters would not)."""
    f = RepeatFilter(window)
    for h in logging.getLogger().handlers:
        h.addFilter(f)
    return f
