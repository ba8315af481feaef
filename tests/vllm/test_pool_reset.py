"""The connector's prefix-cache reset (``lw_vllm.scheduler.pool_reset``) without an engine: the model's key
prefix is purged (other models' objects stay), and the reset reports failure, saying why, when the
backend cannot purge, fails, or objects stayed leased. The engine path (vLLM's reset reaching the
connector, DRAM and disk tier) is in test_disk_tier_e2e.py."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from vllm import SamplingParams
from vllm.v1.request import Request

from lw_core.backends.embedded import EmbeddedBackend
from lw_core.keys import KeySpace
from lw_vllm.pool_events import PoolEvents
from lw_vllm.scheduler import pool_reset

KS = KeySpace(model_fp="aaaaaaaaaaaa", layout_fp="bbbbbbbbbbbb")


def _save(b: EmbeddedBackend, key: str) -> None:
    (h,) = b.reserve([key], 4096)
    assert h is not None
    b.write([h], [0], [np.ones(4096, np.uint8)])
    b.commit([h])


def test_the_models_objects_go_and_other_models_stay(tmp_path) -> None:
    with EmbeddedBackend(str(tmp_path / "pool"), capacity_bytes=1 << 20) as b:
        mine = [KS.key("tp0of1-pp0of1", b"\1" * 16), KeySpace(model_fp=KS.model_fp, layout_fp="other").key("x", b"\2")]
        other = KeySpace(model_fp="cccccccccccc", layout_fp=KS.layout_fp).key("tp0of1-pp0of1", b"\1" * 16)
        for k in (*mine, other):
            _save(b, k)
        ev = PoolEvents(4, enabled=True)
        req = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=1), None)
        ev.stored(req, [b"\1" * 16], {0: [b"\1" * 16]})
        ev.take()
        assert pool_reset.reset_pool(b, KS, ev) is True
        assert [b.lookup([k]) for k in (*mine, other)] == [0, 0, 1]
        assert len(ev.take()) == 1  # the announced chunk is said gone


class _NoPurge:
    name = "memcache"


class _Purge:
    name = "fake"

    def __init__(self, result: dict[str, int] | Exception) -> None:
        self.result = result
        self.prefixes: list[str] = []

    def purge(self, prefix: str, timeout_s: float) -> dict[str, int]:
        self.prefixes.append(prefix)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_a_reset_the_pool_cannot_do_is_a_failure_with_its_reason(caplog) -> None:
    ev = PoolEvents(4, enabled=False)
    cases: list[tuple[Any, str]] = [
        (_NoPurge(), "the memcache backend cannot remove objects"),
        (_Purge(RuntimeError("store down")), "store down"),
        (_Purge({"objects": 3, "leased": 2}), "2 object(s) of this model were being read"),
    ]
    for backend, why in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=pool_reset.__name__):
            assert pool_reset.reset_pool(backend, KS, ev) is False
        assert why in caplog.text, caplog.text
    ok = _Purge({"objects": 1, "bytes": 10, "reservations": 0, "disk_objects": 2, "leased": 0})
    assert pool_reset.reset_pool(ok, KS, ev) is True
    assert ok.prefixes == ["lw1/aaaaaaaaaaaa/"]
