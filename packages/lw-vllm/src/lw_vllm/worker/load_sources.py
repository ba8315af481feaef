"""Which pool objects a worker reads for a load, and how (``LoadSources``, owned by ``WorkerSide``).

A load of chunks this engine's TP size saved reads this rank's own objects. GQA KV saved at another
TP size is put together by ranged reads of the saver ranks' objects that hold this rank's heads
(``lw_core.tp_split``): their key space (that size's page) and the head split are worked out once
per size and kept. MLA's latent KV is the same on every rank, so its keys carry no TP size.
"""

from __future__ import annotations

from typing import Any

from lw_core.config import PoolConfig
from lw_core.keys import KeySpace, rank_tag
from lw_core.plan import ReqLoad
from lw_core.tp_split import HeadSplit, TpSplitError, split_heads
from lw_vllm import pool
from lw_vllm.meta import Xfer


class LoadSources:
    """``block_order``: the order of heads and tokens in this engine's blocks (``kv_layout``); the
    worker sets it again once it has checked its tensors. ``layout``: the layout's name, for errors."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: PoolConfig, keyspace: KeySpace, tag: str,
                 tp_rank: int, tp_size: int, block_order: str | None, layout: str | None) -> None:
        self.vllm_config, self.kv_cache_config, self.cfg = vllm_config, kv_cache_config, cfg
        self.keyspace, self.tag = keyspace, tag
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.block_order, self.layout = block_order, layout
        self._sources: dict[int, tuple[HeadSplit, KeySpace]] = {}

    def req_load(self, x: Xfer) -> ReqLoad:
        """The pipeline's load for ``x``; ``TpSplitError`` when this rank cannot read KV saved at
        ``x.src_tp`` (the scheduler only asks for sizes that split, so that is a bug)."""
        if not x.src_tp or x.src_tp == self.tp_size or pool.is_mla(self.vllm_config):
            return ReqLoad(x.req_id, self.keyspace.keys(self.tag, x.hashes), list(x.block_ids))
        split, ks = self._source(x.src_tp)
        keys = [ks.keys(rank_tag(tp_rank=p, tp_size=x.src_tp), x.hashes) for p in split.src_ranks]
        return ReqLoad(x.req_id, keys[0], list(x.block_ids), split=split, more_keys=keys[1:])

    def _source(self, src_tp: int) -> tuple[HeadSplit, KeySpace]:
        if src_tp not in self._sources:
            total = pool.total_kv_heads(self.vllm_config)
            if total is None:
                raise TpSplitError(f"the model's kv head count is unknown; KV saved at tensor_parallel_size={src_tp} "
                                   f"is not read at tensor_parallel_size={self.tp_size}")
            if self.block_order is None:
                raise TpSplitError(f"the KV cache layout ({self.layout}) does not say how heads and tokens are "
                                   f"ordered in a block; KV saved at tensor_parallel_size={src_tp} is not read at "
                                   f"tensor_parallel_size={self.tp_size}")
            split = split_heads(total, src_tp, self.tp_size, self.tp_rank, order=self.block_order,
                                tokens=pool.block_size(self.kv_cache_config))
            ks = pool.key_space(self.vllm_config, self.kv_cache_config, self.cfg, src_tp)
            self._sources[src_tp] = (split, ks)
        return self._sources[src_tp]
