"""KV cache events with the pool as their medium (``lw_vllm.pool_events``), without an engine:
stored runs with their parent and tokens, removal once a lookup finds an announced chunk gone or a
prefix-cache reset purged the model, the cap on what is remembered, nothing when vLLM publishes no
events."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from lw_vllm.pool_events import MEDIUM, PoolEvents, events_enabled

BS = 4
CHAIN = [bytes([i]) * 16 for i in range(5)]
TOKENS = list(range(100, 100 + 5 * BS + 2))


def test_committed_chunks_are_announced_per_run_with_parent_and_tokens() -> None:
    ev = PoolEvents(BS, enabled=True)
    ev.stored(CHAIN, TOKENS, [CHAIN[3], CHAIN[0], CHAIN[1], b"partial-chunk-key"], lora_name="x")
    a, b = ev.take()
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert a.block_hashes == CHAIN[0:2] and a.parent_block_hash is None and a.token_ids == TOKENS[0:2 * BS]
    assert b.block_hashes == [CHAIN[3]] and b.parent_block_hash == CHAIN[2] and b.token_ids == TOKENS[3 * BS:4 * BS]
    assert a.medium == MEDIUM and a.block_size == BS and a.lora_name == "x"
    assert ev.take() == []


def test_a_lookup_that_finds_announced_chunks_gone_removes_them_once() -> None:
    ev = PoolEvents(BS, enabled=True)
    ev.stored(CHAIN, TOKENS, CHAIN[:4])
    ev.take()
    ev.missing(CHAIN[2:5])  # chunk 2 missing: 2 and 3 were announced, 4 never was
    (rm,) = ev.take()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == CHAIN[2:4] and rm.medium == MEDIUM
    ev.missing(CHAIN[2:5])
    assert ev.take() == []  # already said


def test_a_reset_removes_every_announced_chunk_once() -> None:
    ev = PoolEvents(BS, enabled=True)
    ev.stored(CHAIN, TOKENS, CHAIN[:3])
    ev.take()
    ev.cleared()
    (rm,) = ev.take()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == CHAIN[:3] and rm.medium == MEDIUM
    ev.cleared()
    ev.missing(CHAIN)
    assert ev.take() == []  # nothing left to say


def test_oldest_announcements_are_forgotten_past_the_cap() -> None:
    ev = PoolEvents(BS, enabled=True, max_announced=2)
    ev.stored(CHAIN, TOKENS, CHAIN[:4])
    ev.take()
    ev.missing(CHAIN[0:4])
    (rm,) = ev.take()
    assert rm.block_hashes == CHAIN[2:4]


def test_nothing_is_built_when_vllm_publishes_no_events() -> None:
    assert not events_enabled(SimpleNamespace(kv_events_config=None))
    assert not events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False)))
    assert events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True)))
    ev = PoolEvents(BS, enabled=False)
    ev.stored(CHAIN, TOKENS, CHAIN)
    ev.missing(CHAIN)
    assert ev.take() == []
