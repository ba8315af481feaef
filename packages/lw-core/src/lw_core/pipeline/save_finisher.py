"""Save steps finished in the background: ``SaveFinisher``, owned by ``LayerPipeline``.

A step handed over here already has its layers queued (``SaveStep.submit``); one daemon thread
waits for them and commits (``SaveStep.finish``: the same deadlines and the same rule that only
complete objects become visible), one step at a time in the order they came. The caller keeps the
step's KV blocks untouched until the step's result has been taken (vLLM's delayed freeing), or
until the step stopped reading them (``LayerPipeline.stop_background_reads``: a preempted
request), and gets each result back with the ``tag`` it handed in.

The thread is not one of the save workers: a finish waits on calls that run on those workers, so
running it there could leave every worker waiting for itself.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from lw_core.pipeline.pool import describe, log
from lw_core.pipeline.results import SaveResult
from lw_core.pipeline.save import SaveStep


class SaveFinisher:
    def __init__(self, name: str = "lw-save-finish") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[tuple[SaveStep, Any]] = deque()
        self._running: tuple[SaveStep, Any] | None = None
        self._done: list[tuple[SaveResult, Any]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, step: SaveStep, tag: Any) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("SaveFinisher.submit: closed")
            self._queue.append((step, tag))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def pending(self) -> list[tuple[SaveStep, Any]]:
        """The steps not finished yet (queued or finishing now) with their tags, oldest first."""
        with self._cv:
            running = [self._running] if self._running is not None else []
            return running + list(self._queue)

    def pending_tags(self) -> list[Any]:
        """Tags of the steps not finished yet (queued or finishing now), oldest first."""
        return [t for _, t in self.pending()]

    def take(self) -> list[tuple[SaveResult, Any]]:
        """Finished steps' results with their tags, oldest first; each is returned once."""
        with self._cv:
            out, self._done = self._done, []
            return out

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no step is pending (``True``) or ``timeout_s`` passed (``False``)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self, timeout_s: float) -> bool:
        """Finish what was handed in (bounded by ``timeout_s``), then stop the thread."""
        idle = self.wait_idle(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        return idle

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                self._running = self._queue.popleft()
            step, tag = self._running
            try:
                res = step.finish()
            except Exception as e:  # a bug: nothing was committed by this step after the raise
                log.exception("background save finish failed")
                res = SaveResult(failed_keys=list(step.all_keys), errors=[f"finishing saves: {describe(e)}"])
            with self._cv:
                self._done.append((res, tag))
                self._running = None
                self._cv.notify_all()
