"""What one step's loads and saves report back to the connector."""

from __future__ import annotations

import msgspec


class LoadResult(msgspec.Struct):
    """Outcome of one step's loads. A block is loaded only if every layer of it landed in time;
    every other block of the step is in ``failed_block_ids`` (vLLM recomputes it)."""

    failed_block_ids: list[int] = msgspec.field(default_factory=list)
    failed_req_ids: list[str] = msgspec.field(default_factory=list)
    loaded_objects: int = 0
    loaded_bytes: int = 0
    layer_wait_s: list[float] = msgspec.field(default_factory=list)  # per layer: time wait_layer blocked
    deadline_misses: list[int] = msgspec.field(default_factory=list)  # layers whose wait hit the deadline
    errors: list[str] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed_block_ids and not self.errors


class SaveResult(msgspec.Struct):
    """Outcome of one step's saves. Only ``committed_keys`` became visible; ``failed_keys`` were
    aborted (nothing visible); ``skipped_keys`` existed already or were being written elsewhere."""

    committed_keys: list[str] = msgspec.field(default_factory=list)
    failed_keys: list[str] = msgspec.field(default_factory=list)
    skipped_keys: list[str] = msgspec.field(default_factory=list)
    failed_req_ids: list[str] = msgspec.field(default_factory=list)
    saved_bytes: int = 0
    deadline_misses: list[int] = msgspec.field(default_factory=list)  # layers not written in time
    errors: list[str] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed_keys and not self.errors
