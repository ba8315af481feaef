"""A router-like client subscribes to vLLM's KV events (ZMQ) and learns what the pool holds, on
real vLLM (CPU): the pool's chunks arrive as ``BlockStored`` with medium "CPU" once committed, and
as ``BlockRemoved`` once the engine finds them gone (here: the pool wiped between phases). vLLM's own
prefix cache is off, so every event is the pool's."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest

from lw_dev.harness import pool_dir, random_tokens, run_faulty
from lw_dev.ports import free_port

pytestmark = pytest.mark.slow

BLOCK = 32
P = random_tokens(41, 3 * BLOCK + 7)  # three full chunks


class Subscriber:
    """Binds a SUB socket the engine's publisher connects to; decodes every batch."""

    def __init__(self) -> None:
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.port = free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.events: list[Any] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import zmq

        while not self.stop.is_set():
            if self.sock.poll(100, zmq.POLLIN):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events.extend(self.decoder.decode(payload).events)

    def close(self) -> None:
        time.sleep(0.5)  # the last batches
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def test_router_sees_pool_chunks_stored_then_removed() -> None:
    sub = Subscriber()
    try:
        job = {
            "model": "gqa", "max_tokens": 4, "max_model_len": 1024,
            "engine": {"enable_prefix_caching": False, "block_size": BLOCK,
                       "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                            "endpoint": f"tcp://127.0.0.1:{sub.port}"}},
            "extra": {"embedded_path": pool_dir(), "embedded_capacity_bytes": 64 << 20, "use_layerwise": True},
            "phases": [{"prompts": [P]}, {"prompts": [P]}, {"prompts": [P], "wipe_pool": True}],
        }
        res, _ = run_faulty(job)
    finally:
        sub.close()
    stats = [ph["outputs"][0]["stats"] for ph in res["phases"]]
    assert stats[0]["saved_chunks"] == 3 and stats[1]["loaded_tokens"] == 3 * BLOCK, stats
    assert stats[2]["loaded_tokens"] == 0 and stats[2]["saved_chunks"] == 3, stats
    kinds = [(type(e).__name__, e.medium) for e in sub.events]
    assert all(m == "CPU" for _, m in kinds), kinds
    stored = [e for e in sub.events if type(e).__name__ == "BlockStored"]
    removed = [e for e in sub.events if type(e).__name__ == "BlockRemoved"]
    assert len(stored) == 2 and len(removed) == 1, kinds  # saved, (hit: nothing new), gone, saved again
    first = stored[0]
    assert len(first.block_hashes) == 3 and first.parent_block_hash is None
    assert first.token_ids == P[:3 * BLOCK] and first.block_size == BLOCK
    assert removed[0].block_hashes == first.block_hashes  # the wiped pool: the lookup found them gone
    assert stored[1].block_hashes == first.block_hashes  # same prefix, same chain hashes
