"""Work around vLLM 0.32's CPU rotary kernel mis-rotating 3-D strided inputs (MLA models).

``RotaryEmbedding.forward_cpu`` hands query/key straight to the compiled ``rotary_embedding`` op,
which assumes 2-D token-major tensors. MLA layers pass 3-D strided views instead (the rope part of
q, ``[tokens, heads, rope_dim]`` inside a wider row, and ``k_pe`` as ``[tokens, 1, rope_dim]``), so
the op rotates the wrong rows with the wrong positions. Output then depends on how many tokens a
step holds: a prefix loaded from the pool (or vLLM's own prefix cache) changes later tokens, and
even plain output differs from transformers'. 2-D inputs (GQA/MHA models) are handled correctly.

The fix stages non-2-D inputs through contiguous 2-D copies and writes the result back into the
caller's views in place (the op is in place too). It is applied only on the CPU platform, only for
vLLM versions known to have the bug, and only once; ``LW_VLLM_ROPE_FIX=0`` turns it off (tests use
that to show the bug is still there).
"""

from __future__ import annotations

import logging
from typing import Any

from lw_vllm.cpu_fixes.cpu_fix_gate import needs_fix

log = logging.getLogger(__name__)

# Versions whose CPU rotary op was checked to mis-rotate 3-D strided inputs.
AFFECTED_VERSIONS = ("0.32.",)
_MARK = "_lw_rope_fix_applied"


def _needs_fix() -> tuple[bool, str]:
    return needs_fix("LW_VLLM_ROPE_FIX", AFFECTED_VERSIONS)


def _staged(x: Any) -> Any:
    # [tokens, heads, dim] (any strides) -> contiguous [tokens, heads * dim]; the op's layout.
    return x.reshape(x.shape[0], -1).contiguous()


def apply() -> bool:
    """Patch ``RotaryEmbedding.forward_cpu`` when needed; True if the fix is (now) in place."""
    ok, why = _needs_fix()
    if not ok:
        log.debug("lw-vllm: MLA RoPE fix not applied: %s", why)
        return False
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if getattr(RotaryEmbedding.forward_cpu, _MARK, False):
        return True
    original = RotaryEmbedding.forward_cpu

    def forward_cpu(self: Any, positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return original(self, positions, query, key)
        q2 = _staged(query)
        k2 = None if key is None else _staged(key)
        original(self, positions, q2, k2)
        # A contiguous input is staged as a view of itself: the op already wrote it in place.
        if q2.data_ptr() != query.data_ptr():
            query.copy_(q2.view(query.shape))
        if k2 is not None and k2.data_ptr() != key.data_ptr():  # k2 is None iff key is
            key.copy_(k2.view(key.shape))
        return query, key

    setattr(forward_cpu, _MARK, True)
    forward_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu
    log.info("lw-vllm: applied the CPU RoPE fix for 3-D strided (MLA) inputs (%s)", why)
    return True
