"""The Copier protocol: moves one layer's KV blocks between the KV cache and host bytes.

lw-core knows nothing of torch; lw-vllm implements this with torch's device-agnostic stream/event
API (cpu, cuda, npu). The pipeline calls it from its transfer threads. On a device the copies run
on a side stream and return an event; on the CPU they run in the calling thread (the big memcpy
releases the GIL) and return an already-completed token.

Two optional methods (looked up with ``getattr``; a copier without them works as before):

* ``begin_load() -> None``: called by ``LayerPipeline.start_load`` on the forward thread before any
  load of the step is submitted. A device copier orders the step's host->KV copies after the
  compute stream's work so far (a block's previous owner, vLLM zeroing it).
* ``host_buffer(nbytes) -> buffer``: host memory for the pipeline's staging buffers (pinned memory
  on a device, so the pool reads straight into what the DMA reads).
* ``register_host(buffers) -> None``: called by ``LayerPipeline`` with the backend's
  ``host_regions()`` (when it has them): a device copier registers that memory with the device and
  then copies batches of views in it directly, asynchronously. Called again (from a thread of the
  pipeline's own) when the backend's ``host_regions_epoch`` changes: memory the copier registered
  before that is not among the new buffers is let go once no copy uses it.
* ``addressable(layer, addrs) -> bool``, ``to_kv_at(layer, block_ids, addrs)``,
  ``from_kv_at(layer, block_ids, addrs, after)``: the same copies with the views given by their
  host addresses (a backend's ``view_addresses``), when ``addressable`` says the copier moves
  them directly: no Python object per window on the copy path. ``by_address -> bool`` (a
  property): False when the copier never moves by address (a CPU copier), so the pipeline asks
  the backend for no addresses.

Tokens and the host memory they use: a copy may read its sources (``to_kv``) or write its
destinations (``from_kv``) until its token completes. The pipeline keeps a view's lease until then
(loads) and commits an object only after (saves); a pool object whose copy never completes is
neither released nor aborted by it (the backend's lease or reservation timeout ends it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

Buffer = Any  # buffer-protocol object (memoryview, numpy array)
Token = Any  # completion token of submitted copies (a device event, or None when already done)


@runtime_checkable
class Copier(Protocol):
    def block_nbytes(self, layer: int) -> int:
        """Bytes of one KV block of ``layer`` (opaque: the block is moved whole)."""

    def kv_views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview] | None:
        """Writable host views of these blocks when KV memory is host-addressable (CPU KV cache),
        so a backend can read/write them directly; ``None`` on a device."""

    def to_kv(self, layer: int, block_ids: Sequence[int], srcs: Sequence[Buffer]) -> Token:
        """Submit host -> KV copies of ``srcs[i]`` into block ``block_ids[i]`` of ``layer``."""

    def from_kv(self, layer: int, block_ids: Sequence[int], dsts: Sequence[Buffer], after: Token = None) -> Token:
        """Submit KV -> host copies of block ``block_ids[i]`` of ``layer`` into ``dsts[i]``; on a
        device they start only once ``after`` (an event from ``compute_event``) has completed."""

    def compute_event(self) -> Token:
        """Mark the current point of the compute stream (called in ``save_kv_layer`` right after a
        layer's attention) so a save copy can wait for it without blocking the host."""

    def wait(self, token: Token, timeout_s: float) -> bool:
        """Block the host until ``token``'s copies are done; False on timeout."""

    def make_visible(self, token: Token) -> None:
        """Make the compute stream wait for ``token`` (device: stream-wait-event, no host block;
        CPU: nothing)."""
