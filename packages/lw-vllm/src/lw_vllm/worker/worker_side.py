"""The worker part of LayerwiseStoreConnector: turns each step's plan into LayerPipeline calls.

Hooks per step (vLLM's order): ``start_load_kv`` (before the forward when the step loads, after it
otherwise), per attention layer ``wait_for_layer_load`` then ``save_kv_layer``, then
``wait_for_save``. Saves therefore start lazily at the first ``save_kv_layer`` of a step (or in
``wait_for_save`` in bulk mode). Loads finish in ``wait_for_save``; saves too, except with
background saves (``pool.saves_in_background``: kv_both, dense models), where ``wait_for_save``
hands the step's saves to the pipeline's background finisher and the requests the scheduler frees
late are reported in ``finished_sending`` once none of their saves is running; a preempted
request's saves stop reading its blocks in ``handle_preemptions`` (waited for, then cancelled),
before vLLM reuses them.

Collaborators this side builds and owns: ``LoadSources`` (load_sources: which objects a load
reads), ``WorkerReport`` (worker_report: what goes back to vLLM each pass), and with the KV caches
(``register_kv_caches``) the pipeline, ``SaveLedger`` (save_ledger: save results, late frees),
``RecurrentStates`` (recurrent_states: a hybrid's Mamba / gated delta-net states) and
``StreamLoads`` (stream_loads: streaming PD receives and a hybrid's loads).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lw_core.config import PoolConfig
from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave
from lw_core.tp_split import TpSplitError
from lw_vllm import pool
from lw_vllm.device.copier import TorchCopier, block_order
from lw_vllm.hybrid.group_copier import GroupCopier
from lw_vllm.identity import kv_layout
from lw_vllm.meta import LayerwiseMeta, LayerwiseWorkerMeta, Xfer
from lw_vllm.metrics import Collector, PoolCounters
from lw_vllm.pd.stream_recv import StreamReceiver
from lw_vllm.pool_events import events_enabled
from lw_vllm.worker.load_sources import LoadSources
from lw_vllm.worker.recurrent_states import RecurrentStates
from lw_vllm.worker.save_book import SaveBook
from lw_vllm.worker.save_ledger import SaveLedger
from lw_vllm.worker.stream_loads import StreamLoads
from lw_vllm.worker.worker_report import WorkerReport

log = logging.getLogger(__name__)


def _tp() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # model parallel groups not initialised (unit tests)
        return 0, 1


class WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: PoolConfig, role: str,
                 stats: Collector | None = None) -> None:
        self.vllm_config, self.kv_cache_config, self.cfg = vllm_config, kv_cache_config, cfg
        self.stats = stats if stats is not None else Collector()
        self._pool_counters: PoolCounters | None = None
        self.tp_rank, self.tp_size = _tp()
        self.tag = pool.my_rank_tag(vllm_config, self.tp_rank)
        self.keyspace = pool.key_space(vllm_config, kv_cache_config, cfg)
        # MLA's latent KV is identical on every TP rank: rank 0 alone writes it, every rank reads.
        self.saves_here = not pool.is_mla(vllm_config) or self.tp_rank == 0
        self.layer_index: dict[str, int] = {}
        self.pipe: LayerPipeline | None = None
        self._torch_copier: TorchCopier | None = None
        self.backend: Any = None
        self._meta: LayerwiseMeta | None = None
        self._loading = False
        self._saving = False
        self._load_blocks: dict[str, list[int]] = {}
        self._book = SaveBook()  # this step's saves (background ones come back with theirs)
        self.background = pool.saves_in_background(cfg, role, kv_cache_config)
        self._events = events_enabled(vllm_config)
        self.report = WorkerReport(self.tp_rank)
        self._load_t0 = self._load_t1 = 0.0  # wall clock: this step's load start / last layer in
        # Heads and tokens' order in a block (in the keys; the split reads by it), checked against
        # the tensors in register_kv_caches.
        self.layout = kv_layout.layout_name(vllm_config, kv_cache_config)
        self.block_order = kv_layout.order_of(self.layout)
        self.sources = LoadSources(vllm_config, kv_cache_config, cfg, self.keyspace, self.tag, self.tp_rank,
                                   self.tp_size, self.block_order, self.layout)
        self.role = role
        # Hybrid models (several KV cache groups): chunks are named by the anchor group's blocks and
        # the copier maps them to each layer's group (group_copier); loads go through the receiver
        # (stream_loads), and a failed one is reported per request (vLLM cannot map a hybrid's block
        # ids back).
        self.hybrid = len(kv_cache_config.kv_cache_groups) > 1
        self._groups: GroupCopier | None = None
        # Built with the caches: save results and late frees; recurrent states the pool restores
        # (state_layout); receives (streaming PD decoder, cfg.pd_streaming, or a hybrid's loads).
        self.ledger: SaveLedger | None = None
        self.states: RecurrentStates | None = None
        self.streams: StreamLoads | None = None

    # --- set-up ---
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        names = pool.layer_names(self.kv_cache_config)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise NotImplementedError(f"LayerwiseStoreConnector: KV cache tensors missing for layers {missing[:4]}")
        num_blocks = self.kv_cache_config.num_blocks
        torch_copier = TorchCopier([kv_caches[n] for n in names], num_blocks,
                                   mechanism=self.cfg.device_copy_mechanism)
        self._torch_copier = torch_copier
        copier: Any = torch_copier
        self.block_order = kv_layout.check_tensors(
            self.block_order, self.layout, {n: block_order(kv_caches[n], num_blocks) for n in names})
        self.sources.block_order = self.block_order
        groups = self.kv_cache_config.kv_cache_groups
        layer_group = pool.layer_groups(self.kv_cache_config)
        anchor = pool.anchor_group(self.kv_cache_config)
        if self.hybrid:
            others = [g for g in range(len(groups)) if g != anchor and g not in pool.state_groups(self.kv_cache_config)]
            self._groups = copier = GroupCopier(
                torch_copier, [-1 if layer_group[n] == anchor else others.index(layer_group[n]) for n in names])
        page = groups[anchor].kv_cache_spec.page_size_bytes
        for i, n in enumerate(names):
            if copier.block_nbytes(i) != page or groups[layer_group[n]].kv_cache_spec.page_size_bytes != page:
                raise NotImplementedError(
                    f"LayerwiseStoreConnector: layer {n} has {copier.block_nbytes(i)} bytes per block in its KV "
                    f"tensor but the KV cache spec says {page}; this KV layout is not supported"
                )
        self.layer_index = {n: i for i, n in enumerate(names)}
        layout = ObjectLayout(tuple(copier.block_nbytes(i) for i in range(len(names))))
        self.backend = pool.acquire_backend(self.cfg)
        pool.check_streaming(self.cfg, self.backend)
        self._pool_counters = PoolCounters(self.backend)
        self.states = RecurrentStates.of_model(self.kv_cache_config, self.backend, self.keyspace, self.tag, kv_caches,
                                               num_blocks, self.stats, self.cfg)
        self.pipe = LayerPipeline(
            self.backend,
            copier,
            layout,
            layerwise=self.cfg.use_layerwise,
            prefetch_depth=self.cfg.layerwise_prefetch_layers,
            max_transfer_blocks=self.cfg.layerwise_max_transfer_blocks,
            max_transfer_bytes=self.cfg.layerwise_max_transfer_bytes,
            h2d_stagger_us=self.cfg.h2d_stagger_us,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            layer_timeout_s=self.cfg.layer_wait_timeout_s,
            save_timeout_s=self.cfg.save_timeout_s,
            stream_publish=self.cfg.pd_streaming and self.role in ("kv_producer", "kv_both"),
        )
        if torch_copier.register_failures:
            self.stats.add(device_register_failures=torch_copier.register_failures)
        self.ledger = SaveLedger(self.pipe, self.background, self.report, self.stats, self.cfg.save_timeout_s)
        if (self.cfg.pd_streaming and self.role in ("kv_consumer", "kv_both")) or self.hybrid:
            recv = StreamReceiver(self.backend, copier, layout, self.cfg.metaserver_timeout_s,
                                  threads=self.cfg.stream_recv_threads)
            self.streams = StreamLoads(recv, self.keyspace, self.tag, self._groups, self.states, self.report,
                                       self.stats)
        log.info(
            "lw-vllm: %d layers, %d bytes per block and layer (%s, %s blocks), %s mode, tag %s",
            len(names), page, self.layout, self.block_order, "layerwise" if self.cfg.use_layerwise else "bulk",
            self.tag,
        )

    # --- per step ---
    def bind(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, LayerwiseMeta) else None
        self._loading = self._saving = False

    def start_load_kv(self) -> None:
        self._start_streams()
        meta, pipe = self._meta, self.pipe
        if meta is None or pipe is None or self._loading or not meta.loads:
            return
        loads = []
        for x in meta.loads:
            if self._groups is not None:
                self._groups.add_rows(x.block_ids, x.more)
            load = self.plan_load(x)
            if load is None:
                continue
            loads.append(load)
            self._load_blocks[x.req_id] = list(x.block_ids)
        if not loads:
            return
        self._loading = True
        self._load_t0, self._load_t1 = time.time(), 0.0
        if meta.bulk_load and pipe.layerwise:
            pipe.layerwise = False  # this step only: load every layer now (see LayerwiseMeta.bulk_load)
            try:
                pipe.start_load(loads)
            finally:
                pipe.layerwise = True
        else:
            pipe.start_load(loads)
        if not pipe.layerwise or meta.bulk_load:
            self._load_t1 = time.time()

    def _start_streams(self) -> None:
        meta = self._meta
        if meta is None:
            return
        if self.streams is not None:
            self.streams.start(meta)
            return
        streams, meta.stream_loads = meta.stream_loads, []
        for x in streams:  # the scheduler asked although this worker has no receiver: a bug, recompute
            log.error("lw-vllm: %s: streaming load without pd_streaming on this worker; recomputing", x.req_id)
            self.report.failed_blocks |= set(x.block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        """Streaming receives that ended (``finished_recving``); their failed blocks go out in
        this same pass through ``take_load_errors`` (vLLM calls it right after)."""
        if finished_req_ids and self.ledger is not None:  # their saves ended, or they are freed late
            self.ledger.forget(finished_req_ids, self._meta)
        if self.streams is None:
            return None
        return self.streams.finish(finished_req_ids, self._meta is not None and self._meta.idle)

    def take_finished_sending(self) -> set[str] | None:
        """Background saves: the requests freed late with no save running any more (``SaveLedger``)."""
        return self.ledger.take_finished(self._meta) if self.ledger is not None else None

    def handle_preemptions(self, meta: Any) -> None:
        """vLLM frees a preempted request's blocks at once: its background saves stop reading them
        first (``SaveLedger.wait_preempted``)."""
        if self.ledger is not None:
            self.ledger.wait_preempted(set(getattr(meta, "preempted", None) or ()))

    def take_failed_recving(self) -> set[str]:
        """Hybrid models: requests whose load failed (any block): vLLM recomputes them whole."""
        return self.streams.take_failed_recving() if self.streams is not None else set()

    def plan_load(self, x: Xfer) -> ReqLoad | None:
        """The pipeline's load for ``x`` (``load_sources``); ``None``, with its blocks failed, when
        this rank cannot read KV saved at ``x.src_tp``."""
        try:
            return self.sources.req_load(x)
        except TpSplitError as e:  # the scheduler only asks for sizes that split: a bug, not a hang
            log.error("lw-vllm: %s: cannot load KV saved at another TP size, recomputing: %s", x.req_id, e)
            self.report.fail_blocks(x.req_id, x.block_ids)
            return None

    def _start_save(self) -> None:
        meta, pipe = self._meta, self.pipe
        if self._saving or meta is None or pipe is None:
            return
        self._saving = True
        if not meta.saves or not self.saves_here:
            return
        saves = []
        book = self._book = SaveBook()
        for x in meta.saves:
            if self._groups is not None:
                self._groups.add_rows(x.block_ids, x.more)
            keys = self.keyspace.keys(self.tag, x.hashes)
            saves.append(ReqSave(x.req_id, keys, list(x.block_ids)))
            for k, h in zip(keys, x.hashes):
                book.add(k, x.req_id, h if self._events else None)
        pipe.start_save(saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._loading and self.pipe is not None:
            idx = self.layer_index.get(layer_name)
            if idx is not None:
                self.pipe.wait_layer(idx)
                if idx == len(self.layer_index) - 1 and not self._load_t1:
                    self._load_t1 = time.time()

    def save_kv_layer(self, layer_name: str) -> None:
        if self.pipe is None or self._meta is None:
            return
        self._start_save()
        idx = self.layer_index.get(layer_name)
        if idx is not None:
            self.pipe.save_layer(idx)

    def wait_for_save(self) -> None:
        pipe, meta = self.pipe, self._meta
        if pipe is None or meta is None:
            return
        if self._loading:
            self._finish_load(pipe)
        t0 = time.monotonic()
        if meta.state_saves:  # the boundary states the step's forward wrote (recurrent_states)
            saves, meta.state_saves = meta.state_saves, []
            if self.states is not None and self.saves_here:
                self.states.start_save(saves)  # beside the chunks' saves, within their deadline
        self._start_save()
        assert self.ledger is not None  # built with the pipeline
        self.ledger.finish(self._book, in_step=meta.saves_in_step)
        self._book = SaveBook()
        if self.states is not None:
            self.states.finish_save(t0 + self.cfg.save_timeout_s)

    def _finish_load(self, pipe: LayerPipeline) -> None:
        self._loading = False
        res = pipe.finish_load()
        failed = set(res.failed_block_ids)
        self.report.failed_blocks |= failed
        span = (self._load_t0, self._load_t1 or time.time())
        for rid, blocks in self._load_blocks.items():
            bad = sum(1 for b in blocks if b in failed)
            self.report.loaded(rid, span, len(blocks) - bad, (len(blocks) - bad) * pipe.layout.nbytes)
            if bad:
                self.report.failed(rid, bad)
        self._load_blocks.clear()
        self.stats.add(loaded_objects=res.loaded_objects, loaded_bytes=res.loaded_bytes,
                       load_failed_blocks=len(failed), load_errors=1 if res.errors else 0,
                       load_deadline_misses=len(res.deadline_misses))
        waited = [w for w in res.layer_wait_s if w > 0.0]
        if waited:
            self.stats.observe("layer_wait_s", waited)
        if failed:
            # Name the requests and the cause: under kv_load_failure_policy "fail" vLLM ends them
            # with finish_reason "error" (HTTP 500 "Internal server error") and no message of ours.
            action = "vLLM recomputes them" if self.cfg.kv_load_failure_policy == "recompute" else (
                "kv_load_failure_policy=fail: vLLM fails these requests")
            log.warning("lw-vllm: %d KV blocks of requests %s failed to load, %s; cause: %s", len(failed),
                        res.failed_req_ids, action, "; ".join(res.errors[:3]) or "unknown")
        elif res.errors:
            log.warning("lw-vllm: pool errors during loads (no block affected): %s", "; ".join(res.errors[:3]))

    def poll_pool_stats(self) -> None:
        if self._pool_counters is not None:
            counts = self._pool_counters.poll()
            if counts:
                self.stats.add(**counts)

    def take_load_errors(self) -> set[int]:
        return self.report.take_load_errors()

    def take_report(self) -> LayerwiseWorkerMeta | None:
        return self.report.take()

    def shutdown(self) -> None:
        if self.streams is not None:
            self.streams.close()
            self.streams = None
        if self.states is not None:
            self.states.close()
            self.states = None
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None
        if self._torch_copier is not None:  # unregister the pool memory before the pool goes
            self._torch_copier.close()
            self._torch_copier = None
        if self.backend is not None:
            pool.release_backend(self.cfg, self.backend)
            self.backend = None
