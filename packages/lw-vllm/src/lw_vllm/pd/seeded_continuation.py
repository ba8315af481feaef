"""A seeded request that continues an answered prefill draws what a single engine draws.

lw-proxy continues a non-streamed answer after its prefill (``lw_prefilled``,
``lw_core.wire.DecodeTransferParams``): the decoder gets the prompt plus the prefill's first token
and samples from the second token on. A request with a ``seed`` has its own ``torch.Generator``,
seeded when the model runner first sees the request; a single engine has drawn the first token from
it before it draws the second, so the continuation's generator must be one draw ahead, or every
token it samples differs from the single engine's (right in distribution, but not the seeded answer
a client asked for). The prefiller drew the first token with the same seed (vLLM seeds choice ``i``
of ``n`` with ``seed + i`` on every engine, and lw-proxy sends choice ``i``'s continuation with that
seed).

``apply`` wraps the model runner's ``_update_states``: for each new request that continues a
prefill (``lw_prefilled`` 1) and has a generator, it makes one draw exactly as a sampling step
does, through the runner's own sampler (``TopKTopPSampler``) on one row of dummy logits of the
vocabulary's width: how much a step consumes of a generator depends on the platform's sampling path
(CUDA: an exponential row; vLLM's CPU path: one ``randint``) and on the row's width, never on the
logits, top-k or top-p, so the same call consumes the same. A model runner with speculative
decoding samples through its rejection sampler instead: there a continuation's seeded answer is not
a single engine's (it still follows the same distribution); logged once.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_MARK = "_lw_seeded_continuation"


def continues_prefill(sampling_params: Any) -> bool:
    """Whether a request's sampling parameters say it continues an answered prefill."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    kv = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return isinstance(kv, dict) and kv.get("lw_prefilled") == 1


def advance(runner: Any, generator: Any) -> None:
    """One sampling step's draw from ``generator``, through ``runner``'s sampler."""
    import torch

    logits = torch.zeros(1, runner.input_batch.vocab_size, dtype=torch.float32, device=runner.device)
    runner.sampler.topk_topp_sampler(logits, {0: generator}, None, None)


def advance_new(runner: Any, scheduler_output: Any) -> int:
    """``advance`` the generator of each request new in ``scheduler_output`` that continues a
    prefill; how many were advanced."""
    done = 0
    for new in scheduler_output.scheduled_new_reqs:
        state = runner.requests.get(new.req_id)
        gen = getattr(state, "generator", None)
        if gen is None or not continues_prefill(new.sampling_params):
            continue
        if getattr(runner, "speculative_config", None) is not None:
            if not getattr(runner, "_lw_warned_spec", False):
                runner._lw_warned_spec = True
                log.warning("lw-vllm: with speculative decoding, a seeded request continued after its prefill "
                            "draws other tokens than a single engine (same distribution)")
            continue
        advance(runner, gen)
        done += 1
    return done


def apply() -> bool:
    """Wrap ``GPUModelRunner._update_states`` (the CPU runner inherits it); True once in place."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as e:  # noqa: BLE001 - another vLLM layout: say so, change nothing
        log.debug("lw-vllm: seeded continuations not set up: %s", e)
        return False
    update = GPUModelRunner._update_states
    if getattr(update, _MARK, False):
        return True

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        out = update(self, scheduler_output)
        advance_new(self, scheduler_output)
        return out

    setattr(_update_states, _MARK, True)
    _update_states.__wrapped__ = update  # type: ignore[attr-defined]
    GPUModelRunner._update_states = _update_states
    return True
