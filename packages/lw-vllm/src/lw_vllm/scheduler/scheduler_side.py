"""The scheduler part of LayerwiseStoreConnector: lookups, per-step plans, request bookkeeping.

A chunk is one vLLM block. Hashes are chained over token ids (lw_core.keys), so chunk ``i`` of a
request lives in KV block ``block_ids[i]``. Rules:

* Lookup from the first chunk vLLM lacks locally; a chunk counts only if every needed rank has its
  object; stop at the first miss; at least one prompt token is left to compute (vLLM needs logits).
  Nothing under this engine's TP size: GQA chunks saved at another size whose split divides the kv
  heads count too (every saver rank's object); the load plan names that size and each worker reads
  its heads by byte ranges (``pool_lookup.PoolLookup.at_other_tp``, ``lw_core.tp_split``).
* Loads are synchronous (done within the step that first schedules the request).
* A chunk is saved in the step that completes it (or, for chunks vLLM had cached locally, in the
  first step the request runs), only if it is not known to be in the pool. Saves finish inside
  their step, so ``request_finished`` never has to delay freeing blocks.
* Full prompt chunks are shared by every request. A trailing partial chunk is saved only by a PD
  prefill (``discard_partial_chunks`` false), under a key scoped to its parent request, for that
  parent's decoder requests alone (pd_coordinator).

PD disaggregation (docs/design/architecture.md §6; ``pd_coordinator.PdCoordinator``, which this side owns). Decoder (kv_consumer, or kv_both): a remote-prefill
request is "not ready yet" (``None``) until its prefill is committed, then loads the whole prompt
(even with ``consumer_is_to_load`` false: loading the remote prefill is what a decoder is for; that
flag governs only plain requests sent straight to a decoder). On a metaserver error or after
``metaserver_timeout_s`` the request still looks the pool up (committed objects are always valid
KV) and vLLM computes the rest. Prefiller (kv_producer): looks pool prefixes up and loads them
(``producer_is_to_load``); every full prompt chunk the pool lacks is saved in the step that
computes it and committed in that step's ``wait_for_save``, i.e. before vLLM turns the step's output
into a response, so a ``max_tokens: 1`` prefill is answered only after its objects are visible.

Stats (``LW_VLLM_STATS_FILE``, one JSON line per finished request) are written once the worker
report of the request's last step has arrived, so a prefill's ``saved_chunks`` counts what was
committed before its answer (``request_stats.StatsLog``); the file starts with one engine record
(``engine_facts``: block sizes, state dtypes and bytes, as vLLM decided them on this machine).

Collaborators this side builds and owns: ``PoolLookup`` (pool_lookup: lookups under a deadline),
``PdCoordinator`` (pd_coordinator: PD), ``StatsLog`` (request_stats), ``LateFrees`` (late_frees:
finished requests whose blocks wait for their background saves). It keeps the live requests'
``ReqState`` and the step-plan count.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from lw_core.config import PoolConfig
from lw_core.keys import chunk_hashes
from lw_core.metaserver_allow import MetaserverAllowList
from lw_vllm import pool
from lw_vllm.hybrid import state_layout
from lw_vllm.hybrid.group_blocks import GroupBlocks
from lw_vllm.hybrid.state_plan import StatePlan, last_boundary
from lw_vllm.meta import LayerwiseMeta, LayerwiseWorkerMeta, Xfer
from lw_vllm.metrics import Collector
from lw_vllm.pd import first_token
from lw_vllm.pd.pd_coordinator import PdCoordinator, parent_id
from lw_vllm.pd.pd_metaserver import MetaserverClient
from lw_vllm.pool_events import PoolEvents, events_enabled
from lw_vllm.request.request_state import RemotePhase, ReqState
from lw_vllm.scheduler import pool_reset
from lw_vllm.scheduler.engine_facts import engine_facts
from lw_vllm.scheduler.late_frees import LateFrees
from lw_vllm.scheduler.pool_lookup import PoolLookup
from lw_vllm.scheduler.request_stats import StatsLog

log = logging.getLogger(__name__)

# A step whose forward computes at most this many tokens per scheduled request (decodes, a PD
# decoder's last prompt token) loads in bulk even in layerwise mode.
BULK_LOAD_TOKENS_PER_REQ = 2
# TP sizes another engine of this model may run at: on a miss, those whose GQA heads this engine
# can read by ranges are looked up (README "Prefill and decode at different TP"); all are probed
# when a PD decoder's pool holds none of a committed prefill, to say why.
OTHER_TP_SIZES = (1, 2, 4, 8, 16)


class SchedulerSide:
    """``metrics``: the connector's collector, for what only the scheduler part sees (lookup errors,
    metaserver waits, prefills not in the pool); a fresh one when none is given (tests)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: PoolConfig, role: str,
                 metrics: Collector | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics if metrics is not None else Collector()
        self.block_size = pool.block_size(kv_cache_config)
        # Hybrid models (several KV cache groups): a chunk is a block of every attention group, named
        # by the anchor group's block; loads are asynchronous (vLLM takes a hybrid's load failures
        # per request only, through failed_recving). Models with state groups (Mamba2, gated
        # delta-net) also save and restore the state at chunk boundaries (state_plan) when vLLM keeps
        # block-aligned states ("align" mode); otherwise they run with the pool inert.
        n_groups = len(kv_cache_config.kv_cache_groups)
        state = pool.state_groups(kv_cache_config)
        anchor = pool.anchor_group(kv_cache_config)
        self.groups = GroupBlocks(anchor, [g for g in range(n_groups) if g != anchor and g not in state])
        self.hybrid = n_groups > 1
        why = state_layout.why_not_restorable(kv_cache_config) if state else None
        self.inert = why is not None
        self.states: StatePlan | None = None
        self._async_loads: list[ReqState] = []
        if self.inert:
            log.warning("lw-vllm: this model has recurrent-state layers (KV cache groups %s: Mamba / linear "
                        "attention) and the pool cannot restore their state here (%s), so it neither saves nor "
                        "loads for this model and every request computes its prompt", state, why)
        self.keyspace = pool.key_space(vllm_config, kv_cache_config, cfg)
        self.tags = pool.rank_tags(vllm_config)
        # Key spaces of this model at other TP sizes (GQA: MLA's keys carry no TP size).
        self.other_tp = {} if pool.is_mla(vllm_config) else {
            tp: (pool.key_space(vllm_config, kv_cache_config, cfg, tp), pool.rank_tags(vllm_config, tp))
            for tp in OTHER_TP_SIZES if tp != vllm_config.parallel_config.tensor_parallel_size}
        # A state is saved per rank at this TP size only: no reads across TP sizes for such models.
        self.readable_tp = [] if state else pool.readable_tp_sizes(vllm_config, tuple(self.other_tp))
        # What engines must agree on to share objects (compare across hosts when nothing hits).
        ident = pool.identity(vllm_config, cfg)
        log.info("lw-vllm: pool keys %s (block_size %d, rank tags %s); model fingerprint %s: %s",
                 self.keyspace.key(self.tags[0], b"").rstrip("/") + "/...", self.block_size, ",".join(self.tags),
                 self.keyspace.model_fp, ident.describe())
        if ident.weights.startswith("name:"):
            log.warning("lw-vllm: the model's weights were not found locally, so pool keys name it by %s: engines "
                        "share KV only on that name's word. Pin --revision, or set kv_connector_extra_config "
                        "model_id to a name for exactly these weights.", ident.weights)
        self.can_load = (role == "kv_both" or (role == "kv_consumer" and cfg.consumer_is_to_load)
                         or (role == "kv_producer" and cfg.producer_is_to_load))
        self.can_save = role in ("kv_both", "kv_producer") or (role == "kv_consumer" and cfg.consumer_is_to_put)
        # Background saves: a finished request that had saves planned keeps its blocks until every
        # worker reports them done (finished_sending).
        self.late = LateFrees(pool.saves_in_background(cfg, role, kv_cache_config))
        if self.inert:
            self.can_load = self.can_save = False
        self.backend = pool.acquire_backend(cfg)
        self.lookup = PoolLookup(self.backend, self.keyspace, self.tags, self.other_tp, self.readable_tp,
                                 cfg.lookup_timeout_s, self.metrics)
        layout = state_layout.state_layout(kv_cache_config) if state and not self.inert else None
        if layout is not None:
            self.states = StatePlan(self.lookup, state_layout.state_keyspace(self.keyspace, layout), self.tags,
                                    layout, self.block_size)
        self.reqs: dict[str, ReqState] = {}
        # A prefiller never waits for anyone; a decoder (or a kv_both engine behind the proxy) does.
        metaserver = (MetaserverClient(cfg.metaserver_timeout_s, MetaserverAllowList(cfg.pd_allowed_metaservers),
                                       cfg.pd_metaserver_max_connections)
                      if role in ("kv_consumer", "kv_both") else None)
        self.pd = PdCoordinator(cfg, self.block_size, self.keyspace, self.tags, self.other_tp, metaserver,
                                self.metrics, self.lookup, functools.partial(pool.tp_mismatch, vllm_config),
                                self.groups, states=self.states,
                                forces_first=metaserver is not None and first_token.runs_in(vllm_config))
        self._builds = 0
        self._lag = 1 if getattr(vllm_config.scheduler_config, "async_scheduling", False) else 0
        # Finished requests' stats lines, written once their last step's worker report arrived.
        self.stats = StatsLog.from_env(self.block_size, self._lag)
        if self.stats.path is not None:
            try:
                self.stats.engine(engine_facts(vllm_config, kv_cache_config, layout))
            except Exception as e:  # a diagnostic: never what stops an engine
                log.warning("lw-vllm: cannot describe this engine in the stats file: %s", e)
        # Whether the last get_num_new_matched_tokens call looked the pool up (for lookup metrics:
        # "not ready yet" answers and plain requests on a non-loading role are not lookups).
        self.last_call_looked_up = False
        self._first_step: list[ReqState] = []  # requests whose first scheduled step has not reported yet
        # KV events for routers: a chunk is announced once each saving rank's object is committed.
        self.events = PoolEvents(self.block_size, events_enabled(vllm_config), ranks=len(self.tags))

    # --- helpers ---
    def _state(self, req: Any) -> ReqState:
        st = self.reqs.get(req.request_id)
        if st is None or st.req is not req:
            st = self.reqs[req.request_id] = ReqState.of(req, parent_id(req))
        return st

    def _hashes(self, st: ReqState) -> list[bytes]:
        tokens = st.req.all_token_ids
        if len(tokens) != st.n_tokens:
            st.hashes = chunk_hashes(list(tokens), self.block_size, st.extra, st.input_digests(self.block_size))
            st.n_tokens = len(tokens)
        return st.hashes

    def _skip_published(self, st: ReqState) -> None:
        """A saver that does not load (kv_producer) still skips chunks the pool already holds:
        re-saving them would only be refused by the pool (and report nothing for the request)."""
        n = min(st.prompt_len, len(st.req.all_token_ids)) // self.block_size
        if n <= st.saved_upto:
            return
        try:
            hit = self.lookup(self._hashes(st)[:n])
        except Exception as e:
            log.warning("lw-vllm: lookup failed for %s, saving every chunk: %s", st.req.request_id, e)
            return
        st.saved_upto = max(st.saved_upto, hit)

    # --- vLLM hooks ---
    def get_num_new_matched_tokens(self, req: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.last_call_looked_up = False
        if self.inert:
            return 0, False
        st = self._state(req)
        n_tokens = len(req.all_token_ids)
        remote = self.pd.remote_prefill(st, num_computed_tokens)
        if remote is None:
            return None, False  # vLLM asks again next step
        if remote and st.remote is not None and st.remote.phase is RemotePhase.STREAMING:
            n, is_async = self.pd.stream_match(st, num_computed_tokens)
            self.last_call_looked_up = is_async
            return n, is_async
        if self.hybrid and st.failed_blocks:
            # vLLM retries a hybrid's failed asynchronous load from scratch: it computes, not loads.
            return 0, False
        if not (self.can_load or remote):
            if self.can_save:
                self._skip_published(st)
            return 0, False
        st.local_computed = num_computed_tokens
        if remote and st.parent is not None:
            # The whole prompt, partial chunk included: the decoder computes the last token only.
            # A state model's hit ends at a state before the last token (state_plan.last_boundary).
            hashes = self.pd.prompt_hashes(st)
            limit = len(hashes) if self.states is None else min(len(hashes), last_boundary(n_tokens, self.block_size))
        else:
            hashes = self._hashes(st)
            limit = (n_tokens - 1) // self.block_size  # leave one token to compute
        local = num_computed_tokens // self.block_size
        if limit <= local:
            return 0, False
        self.last_call_looked_up = True
        try:
            # From the first chunk vLLM lacks: chained keys make chunk i valid after any valid prefix.
            seen = st.pool_seen and hashes is st.pd_hashes
            if seen:
                hit = limit
            elif self.events.enabled:  # the tier each chunk is in, for the KV events' medium
                tiers = self.lookup.tiers(hashes[local:limit])
                hit = local + len(tiers)
                self.events.found(req, hashes, local, tiers)
            else:
                hit = local + self.lookup(hashes[local:limit])
            if hit < limit:
                self.events.missing(hashes[hit:limit])
            src_tp = 0
            if hit == local and self.readable_tp:
                hit, src_tp = self.lookup.at_other_tp(hashes, local, limit)
            attn_hit = hit
            if self.states is not None and hit > local:  # the hit ends where a saved state is
                hit = self.states.longest(hashes, local, hit)
        except Exception as e:  # a pool that cannot answer is a miss, never a failed request
            log.warning("lw-vllm: lookup failed for %s, treating as a miss: %s", req.request_id, e)
            return 0, False
        if remote:
            self.pd.check_prefill_visible(st, hashes, local, limit, hit)
        st.load_hashes = hashes
        st.load_src_tp = src_tp
        # A continued prefill's partial chunk is not the full chunk its own prompt may end with.
        full = min(attn_hit, (st.prompt_len - st.prefilled_tail) // self.block_size)
        st.pool_chunks = max(st.pool_chunks, full)
        st.saved_upto = max(st.saved_upto, full)
        tokens = min(hit * self.block_size, n_tokens - 1)
        n = max(0, tokens - num_computed_tokens)
        return n, self.hybrid and n > 0

    def update_state_after_alloc(self, req: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._state(req)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        # Local prefix-cache hits are block aligned; the pool hit extends them (its last block may
        # be the prompt's partial chunk).
        first = st.local_computed // bs
        end = st.local_computed + num_external_tokens
        st.load = (first, -(-end // bs) - first)
        st.promised += num_external_tokens
        streaming = st.remote is not None and st.remote.phase is RemotePhase.STREAMING
        if self.states is not None:  # the block the hit's end state goes to (streamed or not)
            self.states.allocated(st, blocks.get_block_ids())
        if self.hybrid and not streaming:  # asynchronous: vLLM parks the request until the workers report the load
            self.groups.set(st, blocks.get_block_ids())
            self._async_loads.append(st)
            return
        self.pd.park(st, blocks)

    def _plan_async_loads(self, meta: LayerwiseMeta) -> None:
        """Hybrid models: hand the loads vLLM parked to the workers' receiver. Every parked request
        is handed over (an empty one too: the worker reports it failed), or vLLM would wait forever."""
        pending, self._async_loads = self._async_loads, []
        for st in pending:
            rid = st.req.request_id
            if st.load is None or self.reqs.get(rid) is not st:
                continue
            first, n = st.load
            st.load = None
            hashes = st.load_hashes or self._hashes(st)
            end = min(first + n, len(hashes), len(st.block_ids))
            if end < first + n:
                log.error("lw-vllm: %s: %d chunks to load but %d hashes and %d blocks; recomputing", rid,
                          first + n, len(hashes), len(st.block_ids))
                end = first
            x = self.groups.xfer(st, hashes, first, end, st.load_src_tp)
            meta.stream_loads.append(self.states.with_state(x) if self.states is not None else x)
            meta.stream_prefilled.append(rid)  # committed objects: a missing one will not appear
            st.saved_upto = max(st.saved_upto, min(end, st.prompt_len // self.block_size))
            st.last_xfer_build = self._builds

    def build_connector_meta(self, so: Any) -> LayerwiseMeta:
        self._builds += 1
        empty = getattr(so, "total_num_scheduled_tokens", 1) == 0
        self.pd.begin_step(self._builds, empty)
        self.stats.flush(older_than=self._builds - 1 - self._lag)
        meta = LayerwiseMeta()
        self.late.plan(meta, so)
        bs = self.block_size
        scheduled: list[tuple[ReqState, int]] = []
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            self.groups.set(st, nr.block_ids)
            scheduled.append((st, nr.num_computed_tokens + so.num_scheduled_tokens.get(nr.req_id, 0)))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                if new is not None:
                    self.groups.set(st, new)
                else:
                    self.groups.clear(st)
            elif new is not None:
                self.groups.add(st, new)
            scheduled.append((st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)))

        self.pd.plan_streams(meta)
        if self.states is not None and meta.stream_loads:  # streamed hits: their state lands last (worker_side)
            meta.stream_loads = [self.states.with_state(x) for x in meta.stream_loads]
        self._plan_async_loads(meta)
        if self.states is not None and self.can_save:
            meta.state_saves = self.states.saves(so, self.reqs, self._hashes)
        meta.idle = empty
        now = time.time()
        for st, computed_after in scheduled:
            if "sched" not in st.t:
                st.t["sched"] = now
                self._first_step.append(st)
            if st.load is not None:
                first, n = st.load
                st.load = None
                hashes = st.load_hashes or self._hashes(st)
                if n > 0 and first + n <= min(len(hashes), len(st.block_ids)):
                    meta.loads.append(self.groups.xfer(st, hashes, first, first + n, st.load_src_tp))
                    st.saved_upto = max(st.saved_upto, min(first + n, st.prompt_len // bs))
                    st.last_xfer_build = self._builds
            if not self.can_save:
                continue
            full = min(computed_after, st.prompt_len) // bs
            full = min(full, len(st.block_ids))
            if full > st.saved_upto:
                hashes = self._hashes(st)
                full = min(full, len(hashes))
                if full > st.saved_upto:
                    for a, b in self.groups.savable_runs(st, st.saved_upto, full):
                        meta.saves.append(self.groups.xfer(st, hashes, a, b))
                        st.save_planned = True
                        # A PD prefill (even on a kv_both engine behind the proxy) answers after
                        # its commit: a decoder loads it next. Such a step's saves end in the step.
                        meta.saves_in_step |= bool((st.req.kv_transfer_params or {}).get("do_remote_decode"))
                    st.saved_upto = full
                    st.last_xfer_build = self._builds
            partial = self.pd.partial_save(st, computed_after)
            if partial is not None:  # PD prefill: the decoder loads it and computes one token only
                i = st.prompt_len // bs  # the partial chunk (pd_coordinator.partial_save)
                if self.groups.savable_runs(st, i, i + 1):
                    meta.saves.append(Xfer(st.req.request_id, [partial[0]], [partial[1]], 0,
                                           [[m[i]] for m in st.more_blocks]))
                    meta.saves_in_step = True
                st.last_xfer_build = self._builds
        if meta.loads and getattr(so, "total_num_scheduled_tokens", 0) <= BULK_LOAD_TOKENS_PER_REQ * len(scheduled):
            meta.bulk_load = True  # nothing worth overlapping: layer pipelining would only add waits
        return meta

    def update_connector_output(self, out: Any) -> None:
        if self._first_step:
            now = time.time()
            for st in self._first_step:
                st.t.setdefault("step_done", now)
            self._first_step.clear()
        wm = getattr(out, "kv_connector_worker_meta", None)
        if isinstance(wm, LayerwiseWorkerMeta):
            self._apply_report(wm)
        for st in self.late.sent(getattr(out, "finished_sending", None) or ()):  # background saves done
            self.stats.finished(st, self._builds)
        # vLLM finishes requests before it hands the connector the step's report (same call).
        self.stats.flush()

    def _apply_report(self, wm: LayerwiseWorkerMeta) -> None:
        def get(rid: str) -> ReqState | None:
            return self.reqs.get(rid) or self.late.get(rid) or self.stats.finishing(rid)

        for rid, n in wm.loaded.items():
            if (st := get(rid)) is not None:
                st.loaded_blocks += n
        for rid, n in wm.loaded_bytes.items():
            if (st := get(rid)) is not None:
                st.loaded_bytes += n
        for rid, (a, b) in getattr(wm, "load_span", {}).items():
            if (st := get(rid)) is not None and "load_start" not in st.t:
                st.t["load_start"], st.t["load_done"] = a, b
        for rid, n in wm.failed.items():
            if (st := get(rid)) is not None:
                st.failed_blocks += n
        for rid, n in wm.saved.items():  # running totals per request (save_book)
            if (st := get(rid)) is not None:
                st.saved_chunks = max(st.saved_chunks, n)
        for rid, committed in wm.stored.items():  # per TP rank: announced once every rank committed
            if (st := get(rid)) is not None:
                self.events.stored(st.req, self._hashes(st), committed)

    def request_finished(self, req: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self.reqs.pop(req.request_id, None)
        if st is not None:
            st.t["finished"] = time.time()
        if self.states is not None:
            self.states.forget(req.request_id)
        self.pd.request_finished(req.request_id, st)
        if st is not None and self.late.hold(st):  # its background saves may still read these blocks
            return True, None
        if st is not None:
            self.stats.finished(st, self._builds)
        # Its saves (if any) completed inside their step: nothing still reads these blocks.
        return False, None

    def has_pending_block_frees(self) -> bool:
        """Finished requests' blocks held for their background saves (``LateFrees``) come back
        soon: vLLM waits for them rather than preempting a running request."""
        return self.late.pending()

    def request_finished_all_groups(self, req: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.request_finished(req, list(block_ids[self.groups.anchor]) if block_ids else [])

    def reset_pool(self) -> bool:
        """vLLM's prefix-cache reset with the connector's cache: this model's objects leave the
        pool (``pool_reset``)."""
        return pool_reset.reset_pool(self.backend, self.keyspace, self.events)

    def shutdown(self) -> None:
        for st in self.late.drain():
            self.stats.finished(st, self._builds)
        self.stats.close()
        self.pd.close()
        self.lookup.close()
        pool.release_backend(self.cfg, self.backend)
