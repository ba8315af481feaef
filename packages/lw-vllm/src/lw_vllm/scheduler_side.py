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

PD disaggregation (ARCHITECTURE §6). Decoder (kv_consumer, or kv_both): a request whose
``kv_transfer_params`` carry ``do_remote_prefill`` and a ``metaserver`` URL POSTs to the metaserver
once (pd_metaserver, off this thread) and is reported "not ready yet" (``None``) until the answer;
then it is looked up and loaded as usual. Such a request loads even when ``consumer_is_to_load``
is false: loading the remote prefill is what a decoder is for; that flag governs only plain
requests sent straight to a decoder. On a metaserver error or after ``metaserver_timeout_s`` the
request still looks the pool up (committed objects are always valid KV) and vLLM computes the rest.
A prompt with no full chunk to load posts (its siblings' prefill waits for every child) but does
not wait. While requests wait and nothing else runs, one scheduling pass per step may wait up to
``IDLE_WAIT_S`` for an answer, to keep vLLM's empty steps from spinning a CPU core.
Prefiller (kv_producer): every full prompt chunk the pool lacks is saved in the step that computes
it and committed in that step's ``wait_for_save``, i.e. before vLLM turns the step's output into a
response, so a ``max_tokens: 1`` prefill is answered only after its objects are visible.

Stats (``LW_VLLM_STATS_FILE``, one JSON line per finished request) are written once the worker
report of the request's last step has arrived, so a prefill's ``saved_chunks`` counts what was
committed before its answer.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from lw_core.backend import BackendUnavailable
from lw_core.keys import HashExtra, chunk_hashes
from lw_core.pipeline_pool import DeadlineCall, WorkerPool

from lw_vllm import pool
from lw_vllm.meta import LayerwiseMeta, LayerwiseWorkerMeta, Xfer
from lw_vllm.pd_metaserver import MetaserverClient, Outcome, remote_prefill_params

log = logging.getLogger(__name__)

STATS_ENV = "LW_VLLM_STATS_FILE"
# While requests wait for their remote prefill, vLLM runs an empty step about every millisecond
# (scheduler + worker round trip): measured, that burns more than one CPU core, which on a
# shared host starves the very prefiller being waited for. When the last step ran nothing, one
# scheduling pass waits up to this long for a metaserver answer (waking at once on one); a new
# request arriving meanwhile is scheduled at most this much later.
IDLE_WAIT_S = 0.02
# After a lookup timeout, lookups are skipped (misses) for this long: a wedged store then costs
# one deadline every few seconds instead of one per request.
LOOKUP_BACKOFF_S = 5.0


class _Req:
    __slots__ = ("req", "hashes", "n_tokens", "block_ids", "pool_chunks", "saved_upto", "load",
                 "promised", "local_computed", "loaded_blocks", "failed_blocks", "saved_chunks", "prompt_len",
                 "remote", "last_xfer_build")

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
        self.remote: Outcome | str | None = None  # PD: metaserver outcome, or why there was no call
        self.last_xfer_build = -1  # build_connector_meta index of this request's latest load/save


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
        self._lookup_pool = WorkerPool("lw-lookup", size=1)
        self._lookup_paused_until = 0.0
        self.reqs: dict[str, _Req] = {}
        self.stats_path = os.environ.get(STATS_ENV) or None
        self._stats_lock = threading.Lock()
        # A prefiller never waits for anyone; a decoder (or a kv_both engine behind the proxy) does.
        self.metaserver = MetaserverClient(cfg.metaserver_timeout_s) if role in ("kv_consumer", "kv_both") else None
        self._builds = 0
        self._last_step_empty = False
        self._idle_waited_at = -1  # build index of the scheduling pass that last idle-waited
        self._lag = 1 if getattr(vllm_config.scheduler_config, "async_scheduling", False) else 0
        # Finished requests whose last step's worker report has not arrived yet: their stats are
        # written when it does, so saved/loaded counts include the final step.
        self._finishing: dict[str, _Req] = {}
        self.metrics: Any = None  # lw_vllm.metrics.Collector, set by the connector
        # Whether the last get_num_new_matched_tokens call looked the pool up (for lookup metrics:
        # "not ready yet" answers and plain requests on a non-loading role are not lookups).
        self.last_call_looked_up = False

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
        """Leading chunks every needed rank has. Runs under ``lookup_timeout_s``: this is vLLM's
        scheduler loop, and a stalled store must cost a miss, not a stalled engine. After a
        timeout, lookups pause for ``LOOKUP_BACKOFF_S`` (misses at once) instead of paying the
        deadline again for every request."""
        if not hashes:
            return 0
        if time.monotonic() < self._lookup_paused_until:
            raise BackendUnavailable("pool lookups paused after a lookup timeout")

        def run() -> int:
            n = len(hashes)
            for tag in self.tags:
                if n == 0:
                    break
                n = min(n, self.backend.lookup(self.keyspace.keys(tag, hashes[:n])))
            return n

        call = DeadlineCall(self._lookup_pool, run)
        if not call.wait(self.cfg.lookup_timeout_s):
            self._lookup_paused_until = time.monotonic() + LOOKUP_BACKOFF_S
            if self.metrics is not None:
                self.metrics.add(lookup_errors=1)
            raise BackendUnavailable(
                f"pool lookup took longer than lookup_timeout_s={self.cfg.lookup_timeout_s}s; "
                f"lookups paused for {LOOKUP_BACKOFF_S}s"
            )
        if call.error is not None:
            raise call.error
        return call.value

    def _skip_published(self, st: _Req) -> None:
        """A saver that does not load (kv_producer) still skips chunks the pool already holds:
        re-saving them would only be refused by the pool (and report nothing for the request)."""
        n = min(st.prompt_len, len(st.req.all_token_ids)) // self.block_size
        if n <= st.saved_upto:
            return
        try:
            hit = self._lookup(self._hashes(st)[:n])
        except Exception as e:
            log.warning("lw-vllm: lookup failed for %s, saving every chunk: %s", st.req.request_id, e)
            return
        st.saved_upto = max(st.saved_upto, hit)

    def _remote_prefill(self, st: _Req, max_chunks: int) -> bool | None:
        """PD decoder: ``None`` while the metaserver has not answered, else whether this request is
        a remote-prefill one (which loads whatever the pool holds, whatever the outcome)."""
        if self.metaserver is None:
            return False
        req = st.req
        if st.remote is None:
            params = remote_prefill_params(getattr(req, "kv_transfer_params", None))
            if params is None:
                return False
            if isinstance(params, str):
                log.warning("lw-vllm: %s: %s; computing what the pool lacks", req.request_id, params)
                st.remote = params
                return True
            # Post even when this request will not wait: the proxy dispatches the prefill only once
            # every child of the parent has called.
            self.metaserver.post(req.request_id, params)
            if max_chunks <= 0 or getattr(req, "skip_reading_prefix_cache", False):
                st.remote = "nothing to load"
                return True
            st.remote = "waiting"
        if st.remote == "waiting":
            out = self.metaserver.poll(req.request_id)
            if out is None and self._last_step_empty and self._idle_waited_at != self._builds:
                self._idle_waited_at = self._builds
                self.metaserver.wait_for_answer(IDLE_WAIT_S)
                out = self.metaserver.poll(req.request_id)
            if out is None:
                return None
            st.remote = out
            if self.metrics is not None:
                self.metrics.observe("metaserver_wait_s", [out.wait_s])
            if not out.ok:
                log.warning("lw-vllm: %s: remote prefill unavailable (%s); computing what the pool lacks",
                            req.request_id, out.detail)
        return True

    # --- vLLM hooks ---
    def get_num_new_matched_tokens(self, req: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.last_call_looked_up = False
        st = self._state(req)
        max_chunks = (len(req.all_token_ids) - 1) // self.block_size  # leave one token to compute
        remote = self._remote_prefill(st, max_chunks)
        if remote is None:
            return None, False  # vLLM asks again next step
        if not (self.can_load or remote):
            if self.can_save:
                self._skip_published(st)
            return 0, False
        st.local_computed = num_computed_tokens
        hashes = self._hashes(st)
        if max_chunks <= 0:
            return 0, False
        self.last_call_looked_up = True
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
        self._builds += 1
        self._last_step_empty = getattr(so, "total_num_scheduled_tokens", 1) == 0
        self._flush_finishing(older_than=self._builds - 1 - self._lag)
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
                    st.last_xfer_build = self._builds
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
                    st.last_xfer_build = self._builds
        return meta

    def update_connector_output(self, out: Any) -> None:
        wm = getattr(out, "kv_connector_worker_meta", None)
        if isinstance(wm, LayerwiseWorkerMeta):
            self._apply_report(wm)
        # vLLM finishes requests before it hands the connector the step's report (same call).
        self._flush_finishing()

    def _apply_report(self, wm: LayerwiseWorkerMeta) -> None:
        def get(rid: str) -> _Req | None:
            return self.reqs.get(rid) or self._finishing.get(rid)

        for rid, n in wm.loaded.items():
            if (st := get(rid)) is not None:
                st.loaded_blocks += n
        for rid, n in wm.failed.items():
            if (st := get(rid)) is not None:
                st.failed_blocks += n
        for rid, n in wm.saved.items():
            if (st := get(rid)) is not None:
                st.saved_chunks += n

    def request_finished(self, req: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self.reqs.pop(req.request_id, None)
        if self.metaserver is not None:
            # A request that finishes while still waiting was aborted: its call goes too. One that
            # never waited (nothing to load) leaves its call running for its siblings' sake.
            self.metaserver.forget(req.request_id, cancel=st is None or st.remote == "waiting")
        if st is not None and self.stats_path:
            # The report of the step that finished it is still to come only if that step moved
            # its KV (with async scheduling, one more step may have been built meanwhile).
            if st.last_xfer_build >= 0 and st.last_xfer_build >= self._builds - self._lag:
                self._finishing[req.request_id] = st
            else:
                self._write_stats(st)
        # Saves complete inside their step: nothing still reads these blocks.
        return False, None

    def _flush_finishing(self, older_than: int | None = None) -> None:
        for rid, st in list(self._finishing.items()):
            if older_than is None or st.last_xfer_build < older_than:
                del self._finishing[rid]
                self._write_stats(st)

    def _write_stats(self, st: _Req) -> None:
        rec: dict[str, Any] = {
            "req_id": st.req.request_id,
            "prompt_tokens": st.prompt_len,
            "promised_tokens": st.promised,
            "loaded_tokens": st.loaded_blocks * self.block_size,
            "failed_blocks": st.failed_blocks,
            "saved_chunks": st.saved_chunks,
        }
        if st.remote is not None:
            out = st.remote
            rec["remote_prefill"] = out.detail if isinstance(out, Outcome) else out
            rec["metaserver_wait_s"] = round(out.wait_s, 4) if isinstance(out, Outcome) else None
        try:
            with self._stats_lock, open(self.stats_path, "a") as f:  # type: ignore[arg-type]
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            log.warning("lw-vllm: cannot write stats to %s: %s", self.stats_path, e)

    def shutdown(self) -> None:
        if self.stats_path:
            self._flush_finishing()
        if self.metaserver is not None:
            self.metaserver.close()
        self._lookup_pool.close(timeout_s=1.0)
        pool.release_backend(self.cfg, self.backend)
