"""What ``lw-bench pd`` reports: its JSON object (``--json``, ``--save``, ``--out``'s ``result.json``)
is a ``PdBenchResult``; the fields below are the JSON's keys (lw_bench.pd.compare says what the
figures mean). Nested figures are keyed store -> prompt length (a string) -> kind (-> phase).

``compare.summarize`` assembles the figures and ``mode.run`` adds the run's own; the whole is
converted to this struct before it is emitted, so a key the code stops writing, writes with another
type or out of its bounds, or adds unannounced, fails the run instead of changing the JSON quietly.
The per-request ``records`` stay free-form objects (their keys depend on the kind).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

Positive = Annotated[int, Meta(ge=1)]
ByKind = dict[str, float | None]  # kind -> a median (None: no sample)


class PdBenchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lengths: list[Annotated[int, Meta(ge=16, le=4032)]]  # prompt lengths in tokens
    reps: Positive
    block_size: Positive
    pd_max_tokens: Positive  # tokens a PD request streams
    quick: bool
    max_model_len: Positive
    streaming: bool
    stores: list[str]
    throttle_bytes_per_s: Annotated[int, Meta(gt=0)]  # the throttled store's link per engine process
    relay: bool  # prefill-first kinds measured
    request_kinds: list[str]  # lw_bench.pd.request_kinds measured (names of REQUEST_KINDS)
    pin: bool  # the prefiller's processes alone on the first CPU
    continue_streams: bool = False  # the prefill-first proxies run lw-proxy --continue-streams


class TransferHidden(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ready_after_last_layer_ms: float | None  # prefiller's last layer -> decoder's last layer landed
    layer_transfer_ms: Annotated[float, Meta(ge=0)] | None  # the median decoder read of one layer


class PdTargets(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pd_vs_alone: float
    pd_stream_vs_alone: float


class KindFigures(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    alone_s: Annotated[float, Meta(ge=0)] | None  # median, the prefiller alone
    pd_s: Annotated[float, Meta(ge=0)] | None  # median, through the default proxy
    pd_vs_alone: Annotated[float, Meta(gt=0)] | None  # median of per-rep pairs
    relayed_share: Annotated[float, Meta(ge=0, le=1)] | None  # first token relayed (None: no prefill-first proxy)
    # streamed kinds through the proxy, medians: first -> second token event, second -> third
    first_gap_s: Annotated[float, Meta(ge=0)] | None = None
    next_gap_s: Annotated[float, Meta(ge=0)] | None = None
    # streams not relayed, per reason (lw_bench.pd.request_kinds.NOT_RELAYED)
    not_relayed: dict[str, Annotated[int, Meta(ge=1)]] = {}


class PdFiles(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    json: str
    ttft: str
    timeline: str


class PdBenchResult(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    config: PdBenchConfig
    stores: list[str]  # in the order measured
    ttft_s: dict[str, dict[str, ByKind]]  # median TTFT
    ratios: dict[str, dict[str, dict[str, float | None]]]  # medians of per-rep pairs, shares
    phases_s: dict[str, dict[str, dict[str, dict[str, float | None]]]]  # PD kind -> phase -> median
    transfer_hidden: dict[str, dict[str, dict[str, TransferHidden]]]  # PD kind -> figures
    after_prefill_s: dict[str, dict[str, ByKind]]  # prefiller's end -> client's first token
    turn2_prefiller_loaded_tokens: dict[str, dict[str, Annotated[float, Meta(ge=0)] | None]]
    records: list[dict[str, Any]]  # one per request
    problems: list[str]
    targets: PdTargets
    runtime_s: Annotated[float, Meta(ge=0)]
    loadavg: Annotated[float, Meta(ge=0)]  # the machine's 1-minute load average at the end
    cpus: Positive  # CPUs this process may run on
    request_kinds: dict[str, dict[str, dict[str, KindFigures]]] = {}  # store -> length -> request kind
    request_kind_records: list[dict[str, Any]] = []  # one per request of lw_bench.pd.request_kinds
    files: PdFiles | None = None  # --out: what was written there
    plot: str | None = None  # --plot: the TTFT figure written


def checked(result: dict[str, Any]) -> PdBenchResult:
    """The assembled report as the struct; ``msgspec.ValidationError`` names the key that is
    missing, extra, mistyped or out of bounds."""
    return msgspec.convert(result, PdBenchResult)
