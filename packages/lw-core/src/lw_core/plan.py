"""Per-step plans: what a step loads and saves, and how one layer's transfer is batched.

The scheduler builds a ``StepPlan`` per engine step (msgspec: cheap to build, to pickle into
vLLM's connector metadata, and to send between processes). Workers turn it into per-layer
transfer batches. A chunk is one vLLM block here; an object holds one chunk's KV for all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import msgspec

from lw_core.tp_split import HeadSplit


class ObjectLayout(msgspec.Struct, frozen=True):
    """Byte layout of one pool object: one block of every layer, layer-major."""

    layer_nbytes: tuple[int, ...]  # bytes of one block in layer i

    def __post_init__(self) -> None:
        if not self.layer_nbytes or any(n <= 0 for n in self.layer_nbytes):
            raise ValueError(f"layer_nbytes must be non-empty and positive, got {self.layer_nbytes}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_nbytes)

    @property
    def nbytes(self) -> int:
        return sum(self.layer_nbytes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start offset of each layer inside an object."""
        return (0, *accumulate(self.layer_nbytes))[:-1]


class ReqLoad(msgspec.Struct, frozen=True):
    """Load ``keys[i]`` into KV block ``block_ids[i]`` for request ``req_id``.

    KV saved at another TP size (``split``, see ``lw_core.tp_split``): block ``i`` is put together
    by ranged reads from ``keys[i]``, the object of saver rank ``split.src_ranks[0]``, and from
    ``more_keys[j][i]``, that of saver rank ``split.src_ranks[j + 1]``."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    split: HeadSplit | None = None
    more_keys: list[list[str]] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        want = len(self.split.src_ranks) - 1 if self.split is not None else 0
        if len(self.more_keys) != want or any(len(k) != len(self.keys) for k in self.more_keys):
            raise ValueError(f"request {self.req_id}: more_keys must be {want} lists of {len(self.keys)} keys "
                             f"(one per further saver rank of split), got {[len(k) for k in self.more_keys]}")

    def sources(self, i: int) -> list[str]:
        """Every object block ``i`` reads from, in ``split.src_ranks`` order."""
        return [self.keys[i], *(k[i] for k in self.more_keys)]


class ReqSave(msgspec.Struct, frozen=True):
    """Save KV block ``block_ids[i]`` of request ``req_id`` as object ``keys[i]``."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


class StepPlan(msgspec.Struct):
    loads: list[ReqLoad] = msgspec.field(default_factory=list)
    saves: list[ReqSave] = msgspec.field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves


def split_batches(n_items: int, item_nbytes: int, max_blocks: int = 0, max_bytes: int = 0) -> list[range]:
    """Split ``n_items`` equal-sized transfers of one layer into consecutive batches.

    ``max_blocks`` caps items per batch and ``max_bytes`` caps bytes per batch (0 = unlimited).
    A single item larger than ``max_bytes`` still travels, alone: a limit never drops data.
    The caps apply per layer (the reference applied its block cap to all layers at once,
    ``num_layers`` times larger than intended).
    """
    if n_items < 0 or item_nbytes <= 0 or max_blocks < 0 or max_bytes < 0:
        raise ValueError(f"bad batching arguments: {n_items=}, {item_nbytes=}, {max_blocks=}, {max_bytes=}")
    per = n_items if n_items else 1
    if max_blocks:
        per = min(per, max_blocks)
    if max_bytes:
        per = min(per, max(1, max_bytes // item_nbytes))
    return [range(s, min(s + per, n_items)) for s in range(0, n_items, per)]


def stagger_delay_us(stagger_us: int, tp_rank: int, tp_size: int, layer: int) -> int:
    """Delay before a rank's host-to-device copy of ``layer`` so TP ranks don't share the bus at once."""
    if stagger_us <= 0 or tp_size <= 1:
        return 0
    return ((tp_rank + layer) % tp_size) * stagger_us


def flatten(reqs: Sequence[ReqLoad] | Sequence[ReqSave]) -> tuple[list[str], list[int], list[str]]:
    """All (key, block id, request id) of a step, in request order."""
    keys: list[str] = []
    blocks: list[int] = []
    owners: list[str] = []
    for r in reqs:
        if len(r.keys) != len(r.block_ids):
            raise ValueError(f"request {r.req_id}: {len(r.keys)} keys but {len(r.block_ids)} block ids")
        keys.extend(r.keys)
        blocks.extend(r.block_ids)
        owners.extend([r.req_id] * len(r.keys))
    return keys, blocks, owners
