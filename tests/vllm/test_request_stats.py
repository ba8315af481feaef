"""StatsLog (lw_vllm.scheduler.request_stats) on its own: a finished request's line is written at once unless
its last step moved KV, in which case it waits for that step's worker report (``flush``) or for
a step plan built ``1 + lag`` later; nothing is kept without a stats file; a file that cannot be
written is a warning, never an error. The same through SchedulerSide is
tests/pd/test_scheduler_pd.py's prefiller test."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

from lw_vllm.request.request_state import ReqState
from lw_vllm.scheduler.request_stats import STATS_ENV, StatsLog


def _state(rid: str, last_xfer_build: int = -1) -> ReqState:
    st = ReqState(req=SimpleNamespace(request_id=rid), prompt_len=40, promised=32, loaded_blocks=2, saved_chunks=1)
    st.last_xfer_build = last_xfer_build
    st.t["finished"] = 1.23456
    return st


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["req_id"] for line in path.read_text().splitlines()] if path.exists() else []


def test_a_request_waits_for_its_last_steps_report(tmp_path: Path) -> None:
    path = tmp_path / "stats.jsonl"
    log = StatsLog(str(path), block_size=16, lag=0)
    log.finished(_state("no-kv"), build=5)  # its last step moved nothing: no report to wait for
    assert _ids(path) == ["no-kv"]
    moved = _state("moved", last_xfer_build=5)
    log.finished(moved, build=5)
    assert _ids(path) == ["no-kv"] and log.finishing("moved") is moved
    moved.saved_chunks += 2  # the report arrives
    log.flush(older_than=5)  # a plan built since the move only when older_than > 5
    assert _ids(path) == ["no-kv"]
    log.flush()
    assert _ids(path) == ["no-kv", "moved"] and log.finishing("moved") is None
    rec = json.loads(path.read_text().splitlines()[1])
    assert rec == {"req_id": "moved", "prompt_tokens": 40, "promised_tokens": 32, "loaded_tokens": 32,
                   "failed_blocks": 0, "saved_chunks": 3, "loaded_bytes": 0, "t": {"finished": 1.2346}}


def test_async_scheduling_waits_one_more_build(tmp_path: Path) -> None:
    path = tmp_path / "stats.jsonl"
    log = StatsLog(str(path), block_size=16, lag=1)
    log.finished(_state("r", last_xfer_build=4), build=5)  # one more step was built before the report
    assert _ids(path) == []
    log.flush(older_than=5)
    assert _ids(path) == ["r"]
    log.finished(_state("old", last_xfer_build=3), build=5)
    assert _ids(path) == ["r", "old"]


def test_without_a_file_nothing_is_kept(monkeypatch) -> None:
    monkeypatch.delenv(STATS_ENV, raising=False)
    log = StatsLog.from_env(block_size=16, lag=0)
    log.finished(_state("r", last_xfer_build=5), build=5)
    assert log.path is None and log.finishing("r") is None
    log.close()


def test_an_unwritable_file_is_a_warning(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="lw_vllm.scheduler.request_stats")
    log = StatsLog(str(tmp_path / "no-such-dir" / "stats.jsonl"), block_size=16, lag=0)
    log.finished(_state("r"), build=1)
    assert any("cannot write stats" in r.getMessage() for r in caplog.records)
