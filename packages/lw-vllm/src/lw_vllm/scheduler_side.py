"""The scheduler part of LayerwiseStoreConnector: lookups, per-step plans, request bookkeeping.

A chunk is one vLLM block. Hashes are chained over token ids (lw_core.keys), so chunk ``i`` of a
request lives in KV block ``block_ids[i]``. Rules:

* Lookup from chunk 0; a chunk counts only if every needed rank has its object; stop at the first
  miss; at least one prompt token is left to compute (vLLM needs logits).
* Loads are synchronous (done within the step that first schedules the request).
* A chunk is saved in the step that completes it (or, for chunks vLLM had cached locally, in the
  first step the request runs), only if it is not known to be in the pool. Saves finish inside
  their step, so ``request_finished`` never has to delay freeing blocks.
* Only full prompt chunks are shared. A trailing partial chunk would only be useful to the same
  request (its key is request-scoped), so it is not saved here; see the README.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from lw_core.keys import HashExtra, chunk_hashes

from lw_vllm import pool
from lw_vllm.meta import LayerwiseMeta, LayerwiseWorkerMeta, Xfer

log = logging.getLogger(__name__)

STATS_ENV = "LW_VLLM_STATS_FILE"


class _Req:
    __slots__ = ("req", "hashes", "n_tokens", "block_ids", "pool_chunks", "saved_upto", "load",
                 "promised", "local_computed", "loaded_blocks", "failed_blocks", "saved_chunks", "prompt_len")

    def __init__(self, req: Any) -> None:
        self.req = req
        self.hashes: list[bytes] = []
        self.n_tokens = -1  # token count the hashes were computed for
        self.block_ids: list[int] = []
        self.pool_chunks = 0  # leading chunks known to be in the pool
        self.saved_upto = 0  # chunks [0, saved_upto) need no saving
        self.load: tuple[int, int] | None = None  # (first chunk, n chunks) to load this step
        self.promised = 0
        self.local_computed = 0  # tokens vLLM had cached locally at the last lookup
        self.loaded_blocks = 0
        self.failed_blocks = 0
        self.saved_chunks = 0
        self.prompt_len = len(req.prompt_token_ids or ())


def _extra(req: Any) -> HashExtra:
    lora = getattr(req, "lora_request", None)
    mm = getattr(req, "mm_features", None) or ()
    return HashExtra(
        lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        cache_salt=getattr(req, "cache_salt", None),
        mm_hashes=tuple(str(getattr(f, "identifier", f)) for f in mm),
    )


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: Any, role: str) -> None:
        self.cfg = cfg
        self.block_size = pool.block_size(kv_cache_config)
        self.keyspace = pool.key_space(vllm_config, kv_cache_config)
        self.tags = pool.rank_tags(vllm_config)
        self.can_load = role == "kv_both" or (role == "kv_consumer" and cfg.consumer_is_to_load)
        self.can_save = role in ("kv_both", "kv_producer") or (role == "kv_consumer" and cfg.consumer_is_to_put)
        self.backend = pool.acquire_backend(cfg)
        self.reqs: dict[str, _Req] = {}
        self.stats_path = os.environ.get(STATS_ENV) or None
        self._stats_lock = threading.Lock()

    # --- helpers ---
    def _state(self, req: Any) -> _Req:
        st = self.reqs.get(req.request_id)
        if st is None or st.req is not req:
            st = self.reqs[req.request_id] = _Req(req)
        return st

    def _hashes(self, st: _Req) -> list[bytes]:
        tokens = st.req.all_token_ids
        if len(tokens) != st.n_tokens:
            st.hashes = chunk_hashes(list(tokens), self.block_size, _extra(st.req))
            st.n_tokens = len(tokens)
        return st.hashes

    def _lookup(self, hashes: list[bytes]) -> int:
        n = len(hashes)
        for tag in self.tags:
            if n == 0:
                break
            n = min(n, self.backend.lookup(self.keyspace.keys(tag, hashes[:n])))
        return n

    # --- vLLM hooks ---
    def get_num_new_matched_tokens(self, req: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(req)
        if not self.can_load:
            return 0, False
        st.local_computed = num_computed_tokens
        hashes = self._hashes(st)
        max_chunks = (len(req.all_token_ids) - 1) // self.block_size  # leave one token to compute
        if max_chunks <= 0:
            return 0, False
        try:
            hit = self._lookup(hashes[:max_chunks])
        except Exception as e:  # a pool that cannot answer is a miss, never a failed request
            log.warning("lw-vllm: lookup failed for %s, treating as a miss: %s", req.request_id, e)
            return 0, False
        st.pool_chunks = max(st.pool_chunks, hit)
        st.saved_upto = max(st.saved_upto, hit)
        return max(0, hit * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, req: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._state(req)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        # Local prefix-cache hits are block aligned; the pool hit extends them.
        first = st.local_computed // bs
        n = num_external_tokens // bs
        st.load = (first, n)
        st.promised += num_external_tokens

    def build_connector_meta(self, so: Any) -> LayerwiseMeta:
        meta = LayerwiseMeta()
        bs = self.block_size
        scheduled: list[tuple[_Req, int]] = []
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            scheduled.append((st, nr.num_computed_tokens + so.num_scheduled_tokens.get(nr.req_id, 0)))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new[0]) if new is not None else []
            elif new is not None:
                st.block_ids.extend(new[0])
            scheduled.append((st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)))

        for st, computed_after in scheduled:
            if st.load is not None:
                first, n = st.load
                st.load = None
                hashes = self._hashes(st)
                if n > 0 and first + n <= min(len(hashes), len(st.block_ids)):
                    meta.loads.append(Xfer(st.req.request_id, hashes[first:first + n], st.block_ids[first:first + n]))
                    st.saved_upto = max(st.saved_upto, first + n)
            if not self.can_save:
                continue
            full = min(computed_after, st.prompt_len) // bs
            full = min(full, len(st.block_ids))
            if full > st.saved_upto:
                hashes = self._hashes(st)
                full = min(full, len(hashes))
                if full > st.saved_upto:
                    meta.saves.append(Xfer(st.req.request_id, hashes[st.saved_upto:full], st.block_ids[st.saved_upto:full]))
                    st.saved_upto = full
        return meta

    def update_connector_output(self, out: Any) -> None:
        wm = getattr(out, "kv_connector_worker_meta", None)
        if not isinstance(wm, LayerwiseWorkerMeta):
            return
        for rid, n in wm.loaded.items():
            if rid in self.reqs:
                self.reqs[rid].loaded_blocks += n
        for rid, n in wm.failed.items():
            if rid in self.reqs:
                self.reqs[rid].failed_blocks += n
        for rid, n in wm.saved.items():
            if rid in self.reqs:
                self.reqs[rid].saved_chunks += n

    def request_finished(self, req: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self.reqs.pop(req.request_id, None)
        if st is not None and self.stats_path:
            self._write_stats(st)
        # Saves complete inside their step: nothing still reads these blocks.
        return False, None

    def _write_stats(self, st: _Req) -> None:
        rec = {
            "req_id": st.req.request_id,
            "prompt_tokens": st.prompt_len,
            "promised_tokens": st.promised,
            "loaded_tokens": st.loaded_blocks * self.block_size,
            "failed_blocks": st.failed_blocks,
            "saved_chunks": st.saved_chunks,
        }
        try:
            with self._stats_lock, open(self.stats_path, "a") as f:  # type: ignore[arg-type]
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.warning("lw-vllm: cannot write stats to %s: %s", self.stats_path, e)

    def shutdown(self) -> None:
        pool.release_backend(self.cfg, self.backend)
