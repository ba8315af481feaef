"""Mooncake's saves move from the device directly: reservations' local objects live in the put arena
(``lw_mooncake.arena``), which the backend offers as ``host_regions``, so the device copier
registers it and writes each layer into the reservations (``write_buffers``) by the direct
mechanism, and the ranged puts send from there: no pinned staging, no copy into the put staging.
Through the recording fake ops, over Mooncake's object writer and put sessions on an in-memory
store (no Mooncake client)."""

from __future__ import annotations

import ctypes
from collections import Counter

import pytest
import torch
from fake_ops import FakeOps, entries

from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqSave
from lw_mooncake.arena import Arena
from lw_mooncake.calls import Deadlines
from lw_mooncake.object_writer import ObjectWriter
from lw_mooncake.put_sessions import PutSessions
from lw_mooncake.puts import StagedPuts
from lw_mooncake.reservations import Reservations
from lw_mooncake.session_writer import SessionWriter
from lw_vllm.device.copier import TorchCopier

NB, LAYERS = 8, 3
KEYS, BLOCKS = ["k0", "k1", "k2", "k3"], [6, 0, 3, 5]


class _Store:
    """Put sessions as Mooncake keeps them: invisible until ended, ranged puts from registered memory."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.open: dict[str, bytearray] = {}
        self.stored: dict[str, bytes] = {}

    def register_buffer(self, base: int, n: int) -> int:
        self.registered[base] = n
        return 0

    def unregister_buffer(self, base: int) -> int:
        return 0 if self.registered.pop(base, None) is not None else -1

    def batch_put_session_start(self, keys, sizes):
        for k, n in zip(keys, sizes):
            self.open[k] = bytearray(b"\xee" * n)
        return [0] * len(keys)

    def batch_put_from_multi_buffer_ranges(self, keys, ptrs, sizes, offsets):
        for k, ps, ns, offs in zip(keys, ptrs, sizes, offsets):
            for p, n, o in zip(ps, ns, offs):
                assert any(b <= p and p + n <= b + m for b, m in self.registered.items()), "unregistered source"
                self.open[k][o : o + n] = ctypes.string_at(p, n)
        return [sum(ns) for ns in sizes]

    def batch_put_session_end(self, keys):
        for k in keys:
            self.stored[k] = bytes(self.open.pop(k))
        return [0] * len(keys)

    def batch_put_session_revoke(self, keys):
        return [0 if self.open.pop(k, None) is not None else -600 for k in keys]


class _Client:
    def __init__(self) -> None:
        self.store = _Store()
        self.calls = Deadlines(5.0, "test", workers=2)
        self.closed = False

    def check_open(self) -> None:
        pass

    def put_args(self) -> tuple:
        return ()


class _SavingMooncake:
    """The write half of ``MooncakeBackend`` with put sessions (as it builds them)."""

    name = "mooncake"

    def __init__(self, arena_bytes: int) -> None:
        self.client = _Client()
        self.arena = Arena(self.client.store, self.client.calls, arena_bytes, "put")
        self.puts = StagedPuts(self.client, 1 << 20, self.arena)  # type: ignore[arg-type]
        res = Reservations(self.arena)
        sessions = SessionWriter(PutSessions(self.client), self.puts, res, Counter())  # type: ignore[arg-type]
        self.writer = ObjectWriter(self.client, self.puts, res, staging_size=1 << 20, streams=None,  # type: ignore[arg-type]
                                   sessions=sessions)

    def lookup(self, keys):
        return 0

    def reserve(self, keys, nbytes):
        return self.writer.reserve(keys, nbytes)

    def view(self, h, offset, nbytes):
        return self.writer.view(h, offset, nbytes)

    def write_buffers(self, handles, offsets, nbytes):
        return self.writer.write_buffers(handles, offsets, nbytes)

    def write(self, handles, offsets, srcs):
        self.writer.write(handles, offsets, srcs)

    def commit(self, handles):
        self.writer.commit(handles)

    def abort(self, handles):
        self.writer.abort(handles)

    def host_regions(self):
        return [self.arena.region()]

    def close(self):
        self.arena.close()
        self.client.calls.shutdown()


@pytest.mark.parametrize("mechanism, how", [("kernel", "kernel"), ("batch_dma", "batch_dma")])
def test_saves_move_into_the_registered_put_arena_directly_and_put_from_it(mechanism, how):
    g = torch.Generator().manual_seed(9)
    src = [torch.randint(0, 256, (NB, 2, 256), generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
    backend = _SavingMooncake(1 << 20)
    log: list = []
    c = TorchCopier(src, NB, ops=FakeOps(log, layers=src), mechanism=mechanism)
    layout = ObjectLayout(tuple(c.block_nbytes(i) for i in range(LAYERS)))
    with LayerPipeline(backend, c, layout, max_transfer_blocks=3, save_timeout_s=10.0) as pipe:
        (region,) = backend.host_regions()
        assert [e[1:] for _, e in entries(log, "register")] == [(backend.arena.base, region.nbytes)]
        pipe.start_save([ReqSave("r", KEYS, BLOCKS)])
        for layer in range(LAYERS):
            pipe.save_layer(layer)
        res = pipe.finish_save()
    assert res.ok and sorted(res.committed_keys) == KEYS, res.errors
    for k, b in zip(KEYS, BLOCKS):
        assert backend.client.store.stored[k] == b"".join(src[layer][b].numpy().tobytes() for layer in range(LAYERS))
    assert not entries(log, "pinned") and not entries(log, "d2h")  # no pinned staging
    assert c.mechanism_counts[how] == LAYERS * 2  # 4 blocks in batches of 3
    assert backend.puts.counts["put_staged_bytes"] == 0 and backend.puts.counts["put_direct_bytes"] == len(KEYS) * layout.nbytes
    assert backend.arena.free_bytes() == backend.arena.nbytes  # every reservation ended
    c.close()
    backend.close()
