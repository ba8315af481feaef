"""The scheduler part's per-request state (in the style of vLLM's ``RequestOffloadState``): one
``ReqState`` per live request, and for a PD decoder request its remote-prefill phase as an enum
plus the metaserver's ``Outcome`` instead of strings.

Remote-prefill phases (``RemotePhase``), decided once when vLLM first asks about the request:

* ``BAD_PARAMS``: our ``kv_transfer_params`` but malformed, or naming a metaserver this engine may not
  call (``pd_allowed_metaservers``); no call is made, the pool is looked up, vLLM computes the rest.
* ``NOTHING_TO_LOAD``: the prompt is shorter than a chunk (a recurrent-state model's: has no chunk
  boundary before its last token), or the request skips the prefix cache.
* ``POOL_HOLDS_PROMPT``: the local prefix cache plus the pool held every full chunk before posting.
* ``STREAMING``: ``pd_streaming``: posted, and pulling the prompt's layers as the prefiller
  publishes them (vLLM's async load); no metaserver answer is awaited.
* ``WAITING`` -> ``ANSWERED``: the only transition; the metaserver answered (or the prompt appeared
  whole in the pool, which counts as an "ok" answer). ``outcome`` is set exactly in ``ANSWERED``.

The stats record's ``remote_prefill`` value is ``RemotePrefill.detail``: the outcome's detail
("ok", "metaserver answered 502 ...", "no metaserver answer within 2 s"), the bad-params message,
or the phase's own text ("nothing to load", "pool holds the prompt").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from lw_core.keys import HashExtra
from lw_vllm.request.request_keys import hash_extra, input_digests, num_prompt_tokens


@dataclass(frozen=True)
class Outcome:
    """The metaserver's answer to a decoder's call (``lw_vllm.pd.pd_metaserver``), or the pool's
    stand-in for it (the prompt found whole in the pool: ``lw_vllm.pd.pd_coordinator``)."""

    ok: bool
    detail: str  # "ok", or why the decoder recomputes
    wait_s: float
    first_token: int | None = None  # the prefill's first generated token, when the answer carries it
    prompt_digest: str | None = None  # lw_core.wire.prompt_digest of the prompt it followed


class RemotePhase(enum.Enum):
    BAD_PARAMS = "bad params"
    NOTHING_TO_LOAD = "nothing to load"
    POOL_HOLDS_PROMPT = "pool holds the prompt"
    PREFILLED = "continues an answered prefill"
    STREAMING = "streaming"
    WAITING = "waiting"
    ANSWERED = "answered"


@dataclass(slots=True)
class RemotePrefill:
    """A PD decoder request's remote prefill: its phase, and the outcome once answered."""

    phase: RemotePhase
    outcome: Outcome | None = None
    error: str | None = None  # BAD_PARAMS: why the params were refused

    def __post_init__(self) -> None:
        if (self.phase is RemotePhase.ANSWERED) != (self.outcome is not None):
            raise ValueError(f"remote prefill phase {self.phase.name} with outcome {self.outcome!r}: "
                             "an outcome belongs to ANSWERED alone")
        if (self.phase is RemotePhase.BAD_PARAMS) != (self.error is not None):
            raise ValueError(f"remote prefill phase {self.phase.name} with error {self.error!r}: "
                             "an error belongs to BAD_PARAMS alone")

    @property
    def waiting(self) -> bool:
        return self.phase is RemotePhase.WAITING

    @property
    def answered_ok(self) -> bool:
        """The metaserver (or the pool) says the prefill is committed."""
        return self.outcome is not None and self.outcome.ok

    def answer(self, outcome: Outcome) -> None:
        """WAITING -> ANSWERED; any other phase has nothing to wait for."""
        if self.phase is not RemotePhase.WAITING:
            raise ValueError(f"remote prefill answered in phase {self.phase.name}; only WAITING waits for one")
        self.phase, self.outcome = RemotePhase.ANSWERED, outcome

    @property
    def detail(self) -> str:
        """The stats record's ``remote_prefill`` value."""
        if self.outcome is not None:
            return self.outcome.detail
        if self.error is not None:
            return self.error
        return self.phase.value

    @property
    def wait_s(self) -> float | None:
        """How long the metaserver call took (the stats record's ``metaserver_wait_s``)."""
        return self.outcome.wait_s if self.outcome is not None else None


@dataclass(slots=True)
class ReqState:
    """What the scheduler part keeps per request. A chunk is one vLLM block."""

    req: Any  # vllm.v1.request.Request
    hashes: list[bytes] = field(default_factory=list)
    n_tokens: int = -1  # token count the hashes were computed for
    block_ids: list[int] = field(default_factory=list)
    more_blocks: list[list[int]] = field(default_factory=list)  # hybrid: the other attention groups' blocks
    pool_chunks: int = 0  # leading chunks known to be in the pool
    saved_upto: int = 0  # chunks [0, saved_upto) need no saving
    load: tuple[int, int] | None = None  # (first chunk, n chunks) to load this step
    load_src_tp: int = 0  # TP size of the engine that saved what the last lookup found (0: this one's)
    promised: int = 0
    local_computed: int = 0  # tokens vLLM had cached locally at the last lookup
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    failed_blocks: int = 0
    saved_chunks: int = 0
    save_planned: bool = False  # a save of this request was sent to the workers (background saves)
    prompt_len: int = 0
    remote: RemotePrefill | None = None  # PD decoder: None until known to be a remote prefill
    last_xfer_build: int = -1  # build_connector_meta index of this request's latest load/save
    # Wall-clock milestones for the stats record (lw-bench pd's breakdown): a few time.time() calls.
    t: dict[str, float] = field(default_factory=dict)
    parent: str | None = None  # PD: scopes the trailing partial chunk's key
    pd_hashes: list[bytes] | None = None  # prompt's full chunks (+ partial), see PdCoordinator.prompt_hashes
    # PD: the prompt's last tokens that the prefill generated (``DecodeTransferParams.lw_prefilled``);
    # the prefill saved the prompt before them, which is what ``pd_hashes`` name.
    prefilled_tail: int = 0
    load_hashes: list[bytes] = field(default_factory=list)  # the hash list the last lookup used
    partial_saved: bool = False
    next_pool_check: float = 0.0
    posted_mono: float = 0.0
    pool_seen: bool = False  # PD: the whole prompt was seen in the pool while waiting
    first_from_prefill: bool = False  # PD: waits for the prefill's first token (lw_vllm.pd.first_token)
    stream_pending: bool = False  # streaming PD: async load promised, not yet sent to the workers
    stream_sent: bool = False  # streaming PD: the workers were told to receive it
    extra: HashExtra = field(default_factory=HashExtra)  # what the keys hash besides token ids
    _digests: tuple[bytes, ...] | None = None  # per prompt chunk, its embeddings' digest (request_keys)

    def input_digests(self, chunk_size: int) -> tuple[bytes, ...]:
        """Per prompt chunk, a digest of its inputs that are not token ids (computed once)."""
        if self._digests is None:
            self._digests = input_digests(self.req, chunk_size)
        return self._digests

    @classmethod
    def of(cls, req: Any, parent: str | None) -> ReqState:
        return cls(req=req, prompt_len=num_prompt_tokens(req), parent=parent, extra=hash_extra(req),
                   t={"arrival": float(getattr(req, "arrival_time", 0.0) or 0.0)})
