"""The scheduler side's per-request stats file: ``StatsLog``, owned by ``SchedulerSide``.

With ``LW_VLLM_STATS_FILE`` set, one JSON line per finished request is appended to that file
(``lw-bench`` and the engine tests read it): its prompt, promised, loaded and saved counts, its
remote-prefill outcome, and wall-clock milestones (``t``). At start-up the engine appends one
engine record first, ``{"engine": ...}`` (lw_vllm.scheduler.engine_facts: block sizes, state dtypes and
bytes as vLLM decided them here), which has no ``req_id``. A line is written once the worker report
of the request's last step has arrived, so a prefill's ``saved_chunks`` counts what was committed
before its answer: a request whose last step moved KV waits here ("finishing") until a later step's
report, or until a step plan ``1 + lag`` builds later (``lag``: 1 under async scheduling, where one
more step may have been built before the report).

State this module owns: the finishing requests, and the lock the file's appends take.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from lw_vllm.request.request_state import ReqState

log = logging.getLogger(__name__)

STATS_ENV = "LW_VLLM_STATS_FILE"


class StatsLog:
    """``path``: the file (``None``: nothing is kept or written; ``from_env`` reads ``STATS_ENV``);
    ``block_size``: tokens per block, for the loaded-token count; ``lag``: see the module docstring."""

    def __init__(self, path: str | None, block_size: int, lag: int) -> None:
        self.path = path
        self.block_size = block_size
        self.lag = lag
        self._lock = threading.Lock()
        self._finishing: dict[str, ReqState] = {}

    @classmethod
    def from_env(cls, block_size: int, lag: int) -> StatsLog:
        return cls(os.environ.get(STATS_ENV) or None, block_size, lag)

    def engine(self, facts: dict[str, Any]) -> None:
        """Append the engine record ``{"engine": facts}`` (lw_vllm.scheduler.engine_facts): at start-up, before
        any request's line; readers tell it from those by its key (it has no ``req_id``)."""
        self._append({"engine": facts})

    def finishing(self, request_id: str) -> ReqState | None:
        """A finished request whose last worker report is still to come (reports are applied to it)."""
        return self._finishing.get(request_id)

    def finished(self, st: ReqState, build: int) -> None:
        """``st``'s request finished while step plan ``build`` was the latest."""
        if self.path is None:
            return
        # The report of the step that finished it is still to come only if that step moved
        # its KV (with async scheduling, one more step may have been built meanwhile).
        if st.last_xfer_build >= 0 and st.last_xfer_build >= build - self.lag:
            self._finishing[st.req.request_id] = st
        else:
            self._write(st)

    def flush(self, older_than: int | None = None) -> None:
        """Write the finishing requests whose last KV move was planned before build ``older_than``
        (all of them when ``None``)."""
        for rid, st in list(self._finishing.items()):
            if older_than is None or st.last_xfer_build < older_than:
                del self._finishing[rid]
                self._write(st)

    def close(self) -> None:
        if self.path is not None:
            self.flush()

    def _write(self, st: ReqState) -> None:
        path = self.path
        if path is None:
            return
        rec: dict[str, Any] = {
            "req_id": st.req.request_id,
            "prompt_tokens": st.prompt_len,
            "promised_tokens": st.promised,
            "loaded_tokens": min(st.loaded_blocks * self.block_size, st.promised),
            "failed_blocks": st.failed_blocks,
            "saved_chunks": st.saved_chunks,
            "loaded_bytes": st.loaded_bytes,  # read from the pool into the KV cache, every rank
            "t": {k: round(v, 4) for k, v in st.t.items()},
        }
        if st.load_src_tp:
            rec["load_src_tp"] = st.load_src_tp  # loaded KV saved at this other TP size
        if st.remote is not None:
            rec["remote_prefill"] = st.remote.detail
            wait_s = st.remote.wait_s
            rec["metaserver_wait_s"] = None if wait_s is None else round(wait_s, 4)
        self._append(rec)

    def _append(self, rec: dict[str, Any]) -> None:
        path = self.path
        if path is None:
            return
        try:
            with self._lock, open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.warning("lw-vllm: cannot write stats to %s: %s", path, e)
