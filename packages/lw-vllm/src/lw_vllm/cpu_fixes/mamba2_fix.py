"""Work around vLLM 0.32's CPU build failing every Mamba2 prefill with prefix caching on.

With prefix caching, vLLM keeps Mamba2 states in "align" mode: a prefill that crosses a block
boundary asks the SSD scan for the state at every chunk end (``return_intermediate_states``) and
writes the one at the boundary into that block's state slot (``store_prefill_checkpoint``). On the
CPU neither exists: the CPU scan (``mamba_ssm._mamba_chunk_scan_combined_fwd_cpu``) ignores the
flag and returns one state per sequence, so ``mamba_mixer2.conv_ssm_forward`` fails with
``IndexError: index N is out of bounds for dimension 0 with size 1``; and the checkpoint store is
a Triton kernel. So a Mamba2 hybrid (Nemotron-H, Granite 4, Bamba) cannot run with prefix caching,
with or without a connector.

The fix, for the CPU platform and the vLLM versions known to need it, once:

* the scan, when intermediate states are asked for, runs the same CPU kernel once per chunk of
  ``cu_chunk_seqlens`` in order, each chunk starting from the previous chunk's state of its
  sequence (kept in float32, as the kernel keeps it within a call), and returns every chunk's end
  state: the kernel's recurrence is sequential, so the outputs and final states are those of one
  call over the whole sequence;
* the checkpoint store does in torch what the Triton kernel does: for each prefill row with a
  checkpoint, the ``state_len`` inputs before the checkpoint go to the block's conv state and the
  chunk's SSD state to its SSM state.

``LW_VLLM_MAMBA2_FIX=0`` turns it off (a test uses that to show the failure is still there).
"""

from __future__ import annotations

import logging
from typing import Any

from lw_vllm.cpu_fixes.cpu_fix_gate import needs_fix

log = logging.getLogger(__name__)

AFFECTED_VERSIONS = ("0.32.",)
_MARK = "_lw_mamba2_fix_applied"


def _needs_fix() -> tuple[bool, str]:
    return needs_fix("LW_VLLM_MAMBA2_FIX", AFFECTED_VERSIONS)


def chunked_scan(scan: Any) -> Any:
    """``scan`` (the CPU SSD scan) that also returns the state at every chunk end when asked."""
    import torch

    def fwd(x: Any, dt: Any, A: Any, B: Any, C: Any, chunk_size: int, out: Any, D: Any = None, z: Any = None,
            dt_bias: Any = None, initial_states: Any = None, return_intermediate_states: bool = False,
            seq_idx: Any = None, cu_seqlens: Any = None, cu_chunk_seqlens: Any = None,
            last_chunk_indices: Any = None, dt_softplus: bool = False,
            dt_limit: tuple[float, float] = (0.0, float("inf")), state_dtype: Any = None, **kw: Any) -> Any:
        if not return_intermediate_states:
            return scan(x, dt, A, B, C, chunk_size, out, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                        return_intermediate_states=False, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                        cu_chunk_seqlens=cu_chunk_seqlens, last_chunk_indices=last_chunk_indices,
                        dt_softplus=dt_softplus, dt_limit=dt_limit, state_dtype=state_dtype, **kw)
        if cu_chunk_seqlens is None or seq_idx is None:
            raise ValueError("lw-vllm mamba2 fix: intermediate states need cu_chunk_seqlens and seq_idx")
        bounds, seqs = cu_chunk_seqlens.tolist(), seq_idx.tolist()
        last: dict[int, Any] = {}  # sequence -> its latest chunk's end state (float32)
        states = []
        for c, q in enumerate(seqs):
            s, e = bounds[c], bounds[c + 1]
            init = last.get(q)
            if init is None and initial_states is not None:
                init = initial_states[q : q + 1]
            st = scan(x[s:e], dt[s:e], A, B[s:e], C[s:e], chunk_size, out[s:e], D=D,
                      z=None if z is None else z[s:e], dt_bias=dt_bias, initial_states=init,
                      return_intermediate_states=False, seq_idx=None,
                      cu_seqlens=torch.tensor([0, e - s], dtype=torch.int32), cu_chunk_seqlens=None,
                      last_chunk_indices=None, dt_softplus=dt_softplus, dt_limit=dt_limit,
                      state_dtype=torch.float32, **kw)
            last[q] = st
            states.append(st)
        return torch.cat(states).to(state_dtype if state_dtype is not None else x.dtype)

    return fwd


def store_prefill_checkpoint(checkpoint: Any, chunk_idx: Any, x: Any, conv_state: Any, chunk_states: Any,
                             ssm_state: Any, query_start_loc: Any, *, state_len: int) -> None:
    """What vLLM's Triton ``store_prefill_checkpoint`` does, in torch: rows with a checkpoint
    (offset > 0) write the ``state_len`` inputs before it (``x`` is ``(dim, tokens)``) into their
    block's conv state and the chunk's SSD state into its SSM state."""
    offsets = checkpoint.checkpoint_offsets.tolist()
    blocks = checkpoint.state_indices.tolist()
    starts = query_start_loc.tolist()
    for row, src in enumerate(chunk_idx.tolist()):
        if offsets[row] <= 0:
            continue
        end = starts[row] + offsets[row]
        if end < state_len:
            raise ValueError(f"lw-vllm mamba2 fix: checkpoint at token {end} has fewer than {state_len} inputs")
        dst = blocks[row]
        conv_state[dst, :, :state_len] = x[:, end - state_len : end]
        ssm_state[dst].copy_(chunk_states[src].reshape(ssm_state[dst].shape))


def apply() -> bool:
    """Patch vLLM's Mamba2 prefill path when needed; True if the fix is (now) in place."""
    ok, why = _needs_fix()
    if not ok:
        log.debug("lw-vllm: CPU Mamba2 prefix-caching fix not applied: %s", why)
        return False
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    if getattr(ssd_combined._mamba_chunk_scan_combined_fwd, _MARK, False):
        return True
    scan = ssd_combined._mamba_chunk_scan_combined_fwd
    fwd = chunked_scan(scan)
    for fn, orig in ((fwd, scan), (store_prefill_checkpoint, mamba_mixer2.store_prefill_checkpoint)):
        setattr(fn, _MARK, True)
        setattr(fn, "__wrapped__", orig)  # noqa: B010 -- fn's type has no such attribute
    ssd_combined._mamba_chunk_scan_combined_fwd = fwd
    mamba_mixer2.store_prefill_checkpoint = store_prefill_checkpoint
    log.info("lw-vllm: applied the CPU Mamba2 fix for prefix caching (%s)", why)
    return True
