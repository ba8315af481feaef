"""The PD decoder continues from the prefill's first token: ``FirstTokenProcessor``, a vLLM logits
processor, and the rule for when an engine runs it.

lw-proxy relays the prefill's first token to the client before the decoder has one. The decoder's
metaserver answer carries that token (``lw_core.wire.MetaserverResponse.first_token``) and the
scheduler side's PD coordinator puts it in the request's ``SamplingParams.extra_args`` under
``FIRST_TOKEN_ARG`` before vLLM schedules the request. While such a request has generated nothing,
this processor leaves only that token's logit finite, so the decoder's first token is the
prefill's whatever the sampling parameters: the answer cannot disagree with what was relayed, and a
sampled request is relayed as safely as a greedy one. A random-sampled request still draws once for
that token (vLLM's sampler draws for every row), so a seeded request's later tokens are drawn from
the generator state a single engine would have; the log-probs vLLM returns are computed before any
logits processor runs (``logprobs_mode`` ``raw_logprobs``, the default), so the forced token's
entry is the decoder's own.

vLLM builds the processor in every engine where lw-vllm is installed (entry point group
``vllm.logits_processors``), except with speculative decoding, for pooling models and on TPU
(``vllm.v1.sample.logits_processor.build_logitsprocs``); ``runs_in`` says whether an engine is one
of those, and the decoder tells the proxy (``MetaserverRequest.forces_first``). A request without
the argument costs a dict lookup when it joins the batch and nothing per step.
"""

from __future__ import annotations

import copy
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

FIRST_TOKEN_ARG = "lw_first_token"
ENTRY_POINT_GROUP = "vllm.logits_processors"  # vllm.v1.sample.logits_processor.LOGITSPROCS_GROUP
ENTRY_POINT = "lw_vllm.pd.first_token:FirstTokenProcessor"


def forced_token(params: SamplingParams | None) -> int | None:
    """The first token ``params`` ask for (``extra_args[FIRST_TOKEN_ARG]``), else None."""
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict):
        return None
    t = extra.get(FIRST_TOKEN_ARG)
    return t if type(t) is int and t >= 0 else None


def force_first(req: Any, token: int) -> None:
    """Make ``req``'s (a vLLM ``Request`` not scheduled yet) first generated token ``token``. The
    request gets sampling parameters of its own: the children of a request of several choices
    without a seed share one object (``vllm.v1.engine.parallel_sampling``), and each continues from
    its own choice's token."""
    sp = copy.copy(req.sampling_params)
    sp.extra_args = {**(sp.extra_args or {}), FIRST_TOKEN_ARG: token}
    req.sampling_params = sp


def runs_in(vllm_config: VllmConfig) -> bool:
    """Whether vLLM builds ``FirstTokenProcessor`` in this engine's workers."""
    from vllm.platforms import current_platform

    if getattr(vllm_config, "speculative_config", None) is not None or current_platform.is_tpu():
        return False
    if getattr(getattr(vllm_config, "model_config", None), "runner_type", "generate") == "pooling":
        return False
    return any(ep.value == ENTRY_POINT for ep in entry_points(group=ENTRY_POINT_GROUP))


class FirstTokenProcessor(LogitsProcessor):
    """Rows whose request carries ``FIRST_TOKEN_ARG`` and has no output yet: every logit but that
    token's becomes -inf (a token id past the vocabulary leaves the row alone)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self._rows: dict[int, tuple[int, list[int]]] = {}  # batch row -> (token, the request's output ids)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args
        t = extra.get(FIRST_TOKEN_ARG) if isinstance(extra, dict) else None
        if t is not None and (type(t) is not int or t < 0):
            raise ValueError(f"extra_args.{FIRST_TOKEN_ARG}={t!r}: accepted: a token id (an int >= 0)")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new(params: SamplingParams, _prompt: list[int] | None, out: list[int]) -> tuple[int, list[int]] | None:
            t = forced_token(params)
            return None if t is None or out else (t, out)

        process_dict_updates(self._rows, batch_update, new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        for row in [r for r, (_, out) in self._rows.items() if out]:  # it has its first token
            del self._rows[row]
        rows = [r for r, (t, _) in self._rows.items() if r < logits.shape[0] and t < logits.shape[1]]
        if rows:
            r = torch.tensor(rows, dtype=torch.long, device=logits.device)
            t = torch.tensor([self._rows[i][0] for i in rows], dtype=torch.long, device=logits.device)
            keep = logits[r, t].clone()
            # A row whose token is masked already (-inf: a constraint of the decoder excludes it) is
            # left as it is: forcing it would break the grammar.
            masked = ~torch.isfinite(keep)
            logits[r] = torch.where(masked[:, None], logits[r], float("-inf"))
            logits[r, t] = keep
        return logits
