"""The torch copier's device path on a real CUDA device: the same copier and pipeline contract as
``test_device_path_fake`` (which runs it through recording fakes on any machine), plus what only a
device shows: staging is pinned, and copies are asynchronous yet ordered against the compute stream.

Skipped where there is no CUDA device (``scripts/device-check.sh`` runs it on a machine with one).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here; scripts/device-check.sh runs these on a GPU machine"
)

from device_contract import (  # noqa: E402
    NB,
    check_cross_tp,
    check_late_load_never_lands,
    check_pipeline_save_then_load,
    check_round_trip,
    layouts,
)

from lw_vllm.device.copier import TorchCopier  # noqa: E402

DEV = torch.device("cuda", 0)
SLEEP_CYCLES = 400_000_000  # ~0.2-0.4 s of a spinning kernel on current GPUs


def make(tensors, nb):
    return TorchCopier(tensors, nb)


@pytest.mark.parametrize("name", list(layouts()))
def test_round_trip_contract(name):
    check_round_trip(make, DEV, name)


@pytest.mark.parametrize("views", [True, False], ids=["views", "staged"])
def test_pipeline_contract(views):
    check_pipeline_save_then_load(make, DEV, views)


def test_late_load_contract():
    check_late_load_never_lands(make, DEV)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"], ids=["head-major", "token-major-cuda-default"])
def test_cross_tp_contract(layout):
    check_cross_tp(make, DEV, layout)


def test_staging_is_pinned():
    c = TorchCopier([torch.zeros(NB, 4, 64, dtype=torch.uint8, device=DEV)], NB)
    assert torch.from_numpy(c.host_buffer(1 << 16)).is_pinned()
    assert c.dev.staging.acquire(100).is_pinned()


def test_a_load_is_enqueued_without_blocking_and_lands_after_the_compute_before_it():
    kv = torch.zeros(NB, 4, 64, dtype=torch.uint8, device=DEV)
    c = TorchCopier([kv], NB)
    n = c.block_nbytes(0)
    buf = c.host_buffer(2 * n)
    buf[:] = 7
    zeros = c.host_buffer(n)
    zeros[:] = 0
    c.make_visible(c.to_kv(0, [0], [zeros]))  # warm-up: first-use costs are not what is timed
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy
    t0 = time.perf_counter()
    c.begin_load()
    tok = c.to_kv(0, [1, 5], [buf[:n], buf[n:]])
    enqueue_s = time.perf_counter() - t0
    assert not tok.query(), "the load ran before the compute enqueued ahead of it"
    assert enqueue_s < 0.05, f"to_kv blocked the host for {enqueue_s:.3f}s"
    c.make_visible(tok)
    assert c.wait(tok, 30.0)
    torch.cuda.synchronize()
    assert kv[1].eq(7).all() and kv[5].eq(7).all() and not kv[0].any()


def test_a_save_waits_for_its_compute_event_without_blocking_the_host():
    kv = torch.zeros(NB, 4, 64, dtype=torch.uint8, device=DEV)
    c = TorchCopier([kv], NB)
    n = c.block_nbytes(0)
    dst = c.host_buffer(n)
    assert c.wait(c.from_kv(0, [0], [dst], after=c.compute_event()), 30.0)  # warm-up
    torch.cuda._sleep(SLEEP_CYCLES)
    kv[3].fill_(9)  # the "attention" writing the block, behind the sleep on the compute stream
    after = c.compute_event()
    t0 = time.perf_counter()
    tok = c.from_kv(0, [3], [dst], after=after)
    assert time.perf_counter() - t0 < 0.05 and not tok.query()
    assert c.wait(tok, 30.0)
    assert (dst == 9).all(), "the save read the block before the compute wrote it"
