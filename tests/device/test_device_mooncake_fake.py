"""Mooncake's gets move to the device directly: whole fetches, and per-layer ranged gets lent to the
pipeline (``read_lent``), land in the get arena (``lw_mooncake.get_arena``), which the backend
offers as ``host_regions``, so the device copier registers it and moves each layer from it by the
direct mechanism, without pinned staging; the extents are given back only after the copies that
read them completed. Through the recording fake ops, over Mooncake's object reader on an in-memory
store (no Mooncake client)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_ops import FakeOps, entries
from recording_backend import Recording

from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqLoad
from lw_mooncake.calls import Deadlines
from lw_mooncake.errors import OBJECT_NOT_FOUND
from lw_mooncake.get_arena import GetArena
from lw_mooncake.gets import StagedGets
from lw_mooncake.object_reader import ObjectReader
from lw_vllm.device.copier import TorchCopier

NB, LAYERS = 8, 3
KEYS, SRC_BLOCKS, DST_BLOCKS = ["k0", "k1", "k2", "k3"], [6, 0, 3, 5], [2, 7, 4, 1]


class _Store:
    """Objects as bytes; gets write them where they are told, into registered memory only."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.registered: dict[int, int] = {}

    def register_buffer(self, base: int, n: int) -> int:
        self.registered[base] = n
        return 0

    def unregister_buffer(self, base: int) -> int:
        return 0 if self.registered.pop(base, None) is not None else -1

    def batch_get_into(self, keys, ptrs, sizes):
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            assert any(b <= p and p + n <= b + m for b, m in self.registered.items())
            if k not in self.objects:
                out.append(OBJECT_NOT_FOUND)
                continue
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(p))[:] = np.frombuffer(self.objects[k], np.uint8)
            out.append(n)
        return out


    def get_into_ranges(self, bufs, keys, positions, offsets, sizes):
        out = []
        for base, ks, ps, os_, ns in zip(bufs, keys, positions, offsets, sizes):
            per_key = []
            for k, kp, ko, kn in zip(ks, ps, os_, ns):
                whole = np.frombuffer(self.objects[k], np.uint8)
                for p, o, n in zip(kp, ko, kn):
                    assert any(b <= base + p and base + p + n <= b + m for b, m in self.registered.items())
                    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(base + p))[:] = whole[o : o + n]
                per_key.append(list(kn))
            out.append(per_key)
        return out


class _Client:
    def __init__(self, store: _Store) -> None:
        self.store = store
        self.calls = Deadlines(5.0, "test", workers=2)

    def check_open(self) -> None:
        pass

    def sizes(self, keys):
        return {k: len(self.store.objects[k]) for k in keys if k in self.store.objects}


class _WholeMooncake:
    """The read half of ``MooncakeBackend`` (its reader, gets and arena, as it builds them)."""

    name = "mooncake"

    def __init__(self, objects: dict[str, bytes], arena_bytes: int, load: str = "whole") -> None:
        self.client = _Client(_Store(objects))
        self.arena = GetArena(self.client.store, self.client.calls, arena_bytes)
        self.reader = ObjectReader(self.client, StagedGets(self.client, 1 << 20, self.arena), load=load,  # type: ignore[arg-type]
                                   staging_size=1 << 20)

    def lookup(self, keys):
        return self.reader.lookup(keys)

    def open(self, keys):
        return self.reader.open(keys)

    def view(self, h, offset, nbytes):
        return self.reader.view(h, offset, nbytes)

    def read(self, handles, offsets, dsts):
        self.reader.read(handles, offsets, dsts)

    def read_lent(self, handles, offsets, nbytes):
        return self.reader.read_lent(handles, offsets, nbytes)

    def release(self, handles):
        self.reader.release(handles)

    def host_regions(self):
        return [self.arena.region()]

    def close(self):
        self.arena.close()
        self.client.calls.shutdown()


def _kv(fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    if fill:
        return [torch.randint(0, 256, (NB, 2, 256), generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
    return [torch.zeros(NB, 2, 256, dtype=torch.uint8) for _ in range(LAYERS)]


@pytest.fixture(params=["whole"])
def pool(request):
    src = _kv(True)
    objects = {k: b"".join(src[layer][b].numpy().tobytes() for layer in range(LAYERS)) for k, b in zip(KEYS, SRC_BLOCKS)}
    b = _WholeMooncake(objects, 1 << 20, load=request.param)
    yield b, src
    b.close()


@pytest.mark.parametrize("mechanism, how", [("kernel", "kernel"), ("batch_dma", "batch_dma")])
def test_whole_fetches_move_from_the_registered_get_arena_directly_and_are_given_back_after_the_copies(pool, mechanism, how):
    backend, src = pool
    dst = _kv(False)
    log: list = []
    c = TorchCopier(dst, NB, ops=FakeOps(log, layers=dst, auto_complete=False), mechanism=mechanism)
    rec = Recording(backend, lambda: all(ev.done for ev in c.dev.ops.events))
    layout = ObjectLayout(tuple(c.block_nbytes(i) for i in range(LAYERS)))
    ops = c.dev.ops
    with LayerPipeline(rec, c, layout, prefetch_depth=2, max_transfer_blocks=3, layer_timeout_s=10.0) as pipe:
        (region,) = backend.host_regions()
        base = np.frombuffer(region, np.uint8).ctypes.data
        assert [e[1:] for _, e in entries(log, "register")] == [(base, region.nbytes)]
        pipe.start_load([ReqLoad("r", KEYS, DST_BLOCKS)])
        for layer in range(LAYERS):
            pipe.wait_layer(layer)
        assert backend.arena.free_bytes() < (1 << 20)  # held while the copies may still read
        ops.complete_all()
        res = pipe.finish_load()
    assert res.ok, res.errors
    for layer in range(LAYERS):
        for b_src, b_dst in zip(SRC_BLOCKS, DST_BLOCKS):
            assert torch.equal(dst[layer][b_dst], src[layer][b_src]), (layer, b_src, b_dst)
    assert not entries(log, "pinned") and not entries(log, "h2d")  # no staging
    assert c.mechanism_counts[how] == LAYERS * 2  # 4 blocks in batches of 3
    assert rec.wait_for("release") == [("release", 4, True)]  # after every copy completed
    assert backend.arena.free_bytes() == 1 << 20
    ops.auto_complete = True  # close's own fence completes: it does not wait out its timeout
    c.close()


@pytest.mark.parametrize("pool", ["per_layer"], indirect=True)
@pytest.mark.parametrize("mechanism, how", [("kernel", "kernel"), ("batch_dma", "batch_dma")])
def test_per_layer_gets_are_lent_from_the_registered_get_arena_and_given_back_after_their_copies(pool, mechanism, how):
    backend, src = pool
    dst = _kv(False)
    log: list = []
    c = TorchCopier(dst, NB, ops=FakeOps(log, layers=dst, auto_complete=False), mechanism=mechanism)
    ops = c.dev.ops
    given_back: list[bool] = []  # whether the first step's copies had completed, at each give-back
    first_step: list = []  # its copies' events
    lend = backend.read_lent

    def recording_lend(handles, offsets, nbytes):
        got = lend(handles, offsets, nbytes)
        if got is not None:
            back = got.give_back
            got.give_back = lambda: (given_back.append(bool(first_step) and all(ev.done for ev in first_step)), back())[1]
        return got

    backend.read_lent = recording_lend
    layout = ObjectLayout(tuple(c.block_nbytes(i) for i in range(LAYERS)))
    with LayerPipeline(backend, c, layout, prefetch_depth=2, max_transfer_blocks=3, layer_timeout_s=10.0) as pipe:
        for step, keys in enumerate((KEYS, KEYS[:1])):
            pipe.start_load([ReqLoad("r", keys, DST_BLOCKS[: len(keys)])])
            for layer in range(LAYERS):
                pipe.wait_layer(layer)
            if step == 0:
                assert backend.arena.free_bytes() < (1 << 20) and not given_back  # lent while the copies may still read
                first_step.extend(ops.events)
            ops.complete_all()
            res = pipe.finish_load()
            assert res.ok, res.errors
    for layer in range(LAYERS):
        for b_src, b_dst in zip(SRC_BLOCKS, DST_BLOCKS):
            assert torch.equal(dst[layer][b_dst], src[layer][b_src]), (layer, b_src, b_dst)
    assert not entries(log, "pinned") and not entries(log, "h2d")  # no staging
    assert c.mechanism_counts[how] == LAYERS * 2 + LAYERS  # 4 blocks in batches of 3, then 1 block
    assert len(given_back) >= LAYERS * 2 and all(given_back)  # the first step's lends, after their copies
    assert backend.reader.gets.counts["arena_range_gets"] == LAYERS * 3
    ops.auto_complete = True  # close's own fence completes: it does not wait out its timeout
    c.close()
