"""KV cache events with the pool as their medium (``lw_vllm.pool_events``), without an engine:
stored runs with their parent, tokens, LoRA and vLLM's extra keys (cache salt, multimodal inputs),
announced only once every TP rank's object of a chunk is committed (the ranks' reports merged as
vLLM merges them, steps apart); a chunk a lookup finds on disk moves to the "STORAGE" medium;
removal once a lookup finds an announced chunk gone or a prefix-cache reset purged the model, the
cap on what is remembered, nothing when vLLM publishes no events."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from lw_core.backend import TIER_DISK, TIER_DRAM
from lw_vllm.meta import LayerwiseWorkerMeta
from lw_vllm.pool_events import MEDIA, MEDIUM, PoolEvents, events_enabled

BS = 4
CHAIN = [bytes([i]) * 16 for i in range(5)]
TOKENS = list(range(100, 100 + 5 * BS + 2))


def _req(**kw) -> Request:
    return Request("r", TOKENS, SamplingParams(max_tokens=1), None, **kw)


REQ = _req()


def test_committed_chunks_are_announced_per_run_with_parent_and_tokens() -> None:
    ev = PoolEvents(BS, enabled=True)
    ev.stored(REQ, CHAIN, {0: [CHAIN[3], CHAIN[0], CHAIN[1], b"partial-chunk-key"]})
    a, b = ev.take()
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert a.block_hashes == CHAIN[0:2] and a.parent_block_hash is None and a.token_ids == TOKENS[0:2 * BS]
    assert b.block_hashes == [CHAIN[3]] and b.parent_block_hash == CHAIN[2] and b.token_ids == TOKENS[3 * BS:4 * BS]
    assert a.medium == MEDIUM == MEDIUM_CPU and a.block_size == BS and a.lora_name is None and a.extra_keys is None
    assert ev.take() == []


def test_events_carry_the_lora_and_the_extra_keys_vllm_hashes_each_block_with() -> None:
    image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-hash",
                                  mm_position=PlaceholderRange(offset=BS + 1, length=BS))  # blocks 1 and 2
    req = _req(cache_salt="tenant-a", mm_features=[image],
               lora_request=LoRARequest(lora_name="adapter", lora_int_id=7, lora_path="/loras/adapter"))
    ev = PoolEvents(BS, enabled=True)
    ev.stored(req, CHAIN, {0: CHAIN[:2]})
    ev.stored(req, CHAIN, {0: CHAIN[2:4]})
    a, b = ev.take()
    assert a.lora_name == b.lora_name == "adapter" and a.lora_id == b.lora_id == 7
    # Untagged, as vLLM publishes them: the LoRA's name, the image (identifier, its offset from the
    # block's start), the cache salt on the first block only.
    assert a.extra_keys == [("adapter", "tenant-a"), ("adapter", ("img-hash", 1))]
    assert b.extra_keys == [("adapter", ("img-hash", -3)), ("adapter",)]


def _rank_report(rank: int, hashes: list[bytes]) -> LayerwiseWorkerMeta:
    return LayerwiseWorkerMeta(saved={"r": len(hashes)}, stored={"r": {rank: hashes}}, rank=rank)


def test_a_chunk_is_announced_once_every_tp_rank_committed_its_object() -> None:
    ev = PoolEvents(BS, enabled=True, ranks=2)
    step1 = _rank_report(0, CHAIN[:3]).aggregate(_rank_report(1, CHAIN[:1]))  # rank 1 lags behind
    assert isinstance(step1, LayerwiseWorkerMeta)
    ev.stored(REQ, CHAIN, step1.stored["r"])
    (a,) = ev.take()
    assert a.block_hashes == CHAIN[:1]  # chunks 1 and 2: only rank 0's objects are readable yet
    step2 = _rank_report(1, CHAIN[1:3]).aggregate(LayerwiseWorkerMeta(rank=0))  # its background saves end
    assert isinstance(step2, LayerwiseWorkerMeta)
    ev.stored(REQ, CHAIN, step2.stored["r"])
    (b,) = ev.take()
    assert b.block_hashes == CHAIN[1:3] and b.parent_block_hash == CHAIN[0]
    ev.stored(REQ, CHAIN, {0: CHAIN[:3], 1: CHAIN[:3]})
    assert ev.take() == []  # announced once


def test_a_chunk_found_on_disk_moves_to_the_storage_medium() -> None:
    assert MEDIA == {TIER_DRAM: MEDIUM_CPU, TIER_DISK: MEDIUM_STORAGE}
    ev = PoolEvents(BS, enabled=True)
    ev.stored(REQ, CHAIN, {0: CHAIN[:4]})
    ev.take()
    ev.found(REQ, CHAIN, 1, [TIER_DISK, TIER_DISK, TIER_DRAM])  # chunks 1 and 2 were demoted to disk
    rm, st = ev.take()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == CHAIN[1:3] and rm.medium == MEDIUM_CPU
    assert isinstance(st, BlockStored) and st.block_hashes == CHAIN[1:3] and st.medium == MEDIUM_STORAGE
    assert st.parent_block_hash == CHAIN[0] and st.token_ids == TOKENS[BS:3 * BS]
    ev.found(REQ, CHAIN, 0, [TIER_DRAM, TIER_DISK, TIER_DISK, TIER_DRAM])
    assert ev.take() == []  # said already
    ev.missing(CHAIN[1:5])  # gone from disk: removed from the medium it was announced in
    (gone_disk, gone_cpu) = ev.take()
    assert gone_disk.block_hashes == CHAIN[1:3] and gone_disk.medium == MEDIUM_STORAGE
    assert gone_cpu.block_hashes == [CHAIN[3]] and gone_cpu.medium == MEDIUM_CPU


def test_a_lookup_that_finds_announced_chunks_gone_removes_them_once() -> None:
    ev = PoolEvents(BS, enabled=True)
    ev.stored(REQ, CHAIN, {0: CHAIN[:4]})
    ev.take()
    ev.missing(CHAIN[2:5])  # chunk 2 missing: 2 and 3 were announced, 4 never was
    (rm,) = ev.take()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == CHAIN[2:4] and rm.medium == MEDIUM
    ev.missing(CHAIN[2:5])
    assert ev.take() == []  # already said


def test_a_reset_removes_every_announced_chunk_once() -> None:
    ev = PoolEvents(BS, enabled=True)
    ev.stored(REQ, CHAIN, {0: CHAIN[:3]})
    ev.take()
    ev.cleared()
    (rm,) = ev.take()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == CHAIN[:3] and rm.medium == MEDIUM
    ev.cleared()
    ev.missing(CHAIN)
    assert ev.take() == []  # nothing left to say


def test_oldest_announcements_are_forgotten_past_the_cap() -> None:
    ev = PoolEvents(BS, enabled=True, max_announced=2)
    ev.stored(REQ, CHAIN, {0: CHAIN[:4]})
    ev.take()
    ev.missing(CHAIN[0:4])
    (rm,) = ev.take()
    assert rm.block_hashes == CHAIN[2:4]


def test_nothing_is_built_when_vllm_publishes_no_events() -> None:
    assert not events_enabled(SimpleNamespace(kv_events_config=None))
    assert not events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False)))
    assert events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True)))
    ev = PoolEvents(BS, enabled=False)
    ev.stored(REQ, CHAIN, {0: CHAIN})
    ev.found(REQ, CHAIN, 0, [TIER_DISK] * 5)
    ev.missing(CHAIN)
    assert ev.take() == []


def test_the_scheduler_side_moves_chunks_a_lookup_finds_on_disk_to_the_storage_medium(tmp_path) -> None:
    """Wired as vLLM drives it: the workers report three committed chunks (announced "CPU"); DRAM
    pressure demotes them to the embedded pool's disk tier; the next lookup hits them on disk and
    the scheduler side says so ("STORAGE")."""
    from lw_core.config import parse_config
    from lw_vllm.scheduler.scheduler_side import SchedulerSide

    block, obj = 16, 200_000  # five objects fit the 1 MiB arena
    cfg = parse_config({"embedded_path": str(tmp_path / "pool"), "embedded_capacity_bytes": 1 << 20,
                        "embedded_disk_path": str(tmp_path / "disk")})
    spec = SimpleNamespace(block_size=block, page_size_bytes=4096)
    kc = SimpleNamespace(num_blocks=8, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-test", dtype="float32", use_mla=False, hf_config=SimpleNamespace(),
                                     get_total_num_kv_heads=lambda: 2),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=True),
    )
    side = SchedulerSide(vc, kc, cfg, "kv_both")
    try:
        req = Request("r", list(range(3, 3 + 3 * block + 1)), SamplingParams(max_tokens=1), None)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing in the pool yet
        hashes = side._hashes(side.reqs["r"])
        b = side.backend

        def put(keys: list[str]) -> None:
            for h in b.reserve(keys, obj):
                assert h is not None
                b.write([h], [0], [bytes(obj)])
                b.commit([h])

        put(side.keyspace.keys(side.tags[0], hashes))
        side.update_connector_output(SimpleNamespace(finished_sending=None, kv_connector_worker_meta=LayerwiseWorkerMeta(
            saved={"r": 3}, stored={"r": {0: hashes}})))
        (st,) = side.events.take()
        assert st.block_hashes == hashes and st.medium == MEDIUM_CPU
        put([f"filler{i}" for i in range(5)])  # the three chunks go to disk
        assert b._disk.flush() and b.lookup_tiers(side.keyspace.keys(side.tags[0], hashes)) == [TIER_DISK] * 3
        assert side.get_num_new_matched_tokens(req, 0) == (3 * block, False)
        rm, moved = side.events.take()
        assert rm.block_hashes == hashes and rm.medium == MEDIUM_CPU
        assert moved.block_hashes == hashes and moved.medium == MEDIUM_STORAGE and moved.token_ids == req.all_token_ids[:3 * block]
    finally:
        side.shutdown()
