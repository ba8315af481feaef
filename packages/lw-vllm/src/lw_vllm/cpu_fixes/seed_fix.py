"""Work around vLLM 0.32's CPU engine dying on a seeded request whose prefill is chunked.

A request with ``seed`` has its own ``torch.Generator``. A step that computes only part of a
prompt samples a token it then discards, and vLLM rewinds that generator so the discarded sample
leaves no trace: ``gen.set_offset(gen.get_offset() - 4)`` in ``_bookkeeping_sync``. Only CUDA's
Philox generators have an offset; a CPU generator raises ``RuntimeError: CPU Generator does not use
offset`` and the engine core dies. Any client can send such a request (``seed`` plus a prompt longer
than ``max_num_batched_tokens``), and through the PD proxy the prefill carries the client's sampling
parameters, so one request ends a prefiller.

The fix does the rewind the CPU way: the state of each generator whose request will discard this
step's sample is saved before sampling and restored after it, and those generators are kept out of
``_bookkeeping_sync``'s offset rewind. Seeded output is then the same whether or not the prefill was
chunked, as on CUDA. Applied only on the CPU platform, only for vLLM versions known to need it, and
only once; ``LW_VLLM_SEED_FIX=0`` turns it off (tests use that to show the crash is still there).
"""

from __future__ import annotations

import logging
from typing import Any

from lw_vllm.cpu_fixes.cpu_fix_gate import needs_fix

log = logging.getLogger(__name__)

AFFECTED_VERSIONS = ("0.32.",)
_MARK = "_lw_seed_fix_applied"


def _needs_fix() -> tuple[bool, str]:
    return needs_fix("LW_VLLM_SEED_FIX", AFFECTED_VERSIONS)


def _discarding(runner: Any) -> list[int]:
    """Batch rows whose sample this step is discarded (a prefill chunk short of the prompt's end)."""
    n = runner.input_batch.num_reqs
    return [i for i in range(n) if runner.discard_request_mask.np[i]]


def apply() -> bool:
    """Patch the CPU model runner when needed; True if the fix is (now) in place."""
    ok, why = _needs_fix()
    if not ok:
        log.debug("lw-vllm: CPU seeded-sampling fix not applied: %s", why)
        return False
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner._sample, _MARK, False):
        return True
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = self.input_batch.generators
        saved = {i: gens[i].get_state() for i in _discarding(self) if i in gens}
        out = sample(self, *args, **kwargs)
        for i, state in saved.items():  # the discarded sample leaves no trace, as CUDA's rewind
            gens[i].set_state(state)
        return out

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = self.input_batch.generators
        held = {i: gens.pop(i) for i in _discarding(self) if i in gens}  # rewound in _sample already
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(held)

    for fn, orig in ((_sample, sample), (_bookkeeping_sync, bookkeeping)):
        setattr(fn, _MARK, True)
        fn.__wrapped__ = orig  # type: ignore[attr-defined]
    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    log.info("lw-vllm: applied the CPU seeded-sampling fix for chunked prefills (%s)", why)
    return True
