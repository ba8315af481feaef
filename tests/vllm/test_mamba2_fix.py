"""``lw_vllm.cpu_fixes.mamba2_fix`` against vLLM's own CPU SSD scan, without an engine: the per-chunk scan
gives the outputs and final states of one call over each whole sequence, and every chunk's end
state; the torch checkpoint store writes what the Triton kernel writes."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _scan() -> object:
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm

    return mamba_ssm._mamba_chunk_scan_combined_fwd_cpu


def _inputs(lengths: list[int], chunk: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n, heads, hd, groups, ds = sum(lengths), 4, 16, 1, 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    bounds, seqs = [0], []
    for q, L in enumerate(lengths):  # chunks of ``chunk`` tokens within each sequence
        start = int(cu[q])
        for s in range(0, L, chunk):
            bounds.append(start + min(s + chunk, L))
            seqs.append(q)
    return {
        "x": torch.randn(n, heads, hd, generator=g), "dt": torch.randn(n, heads, generator=g),
        "A": -torch.rand(heads, generator=g), "B": torch.randn(n, groups, ds, generator=g),
        "C": torch.randn(n, groups, ds, generator=g), "D": torch.randn(heads, generator=g),
        "dt_bias": torch.randn(heads, generator=g), "cu_seqlens": cu,
        "cu_chunk_seqlens": torch.tensor(bounds, dtype=torch.int32), "seq_idx": torch.tensor(seqs, dtype=torch.int32),
        "initial_states": torch.randn(len(lengths), heads, hd, ds, generator=g),
    }


def _call(fn: object, a: dict, out: torch.Tensor, intermediate: bool) -> torch.Tensor:
    last = torch.tensor([i for i in range(len(a["seq_idx"])) if i + 1 == len(a["seq_idx"])
                         or a["seq_idx"][i + 1] != a["seq_idx"][i]])
    return fn(a["x"], a["dt"], a["A"], a["B"], a["C"], 32, out, D=a["D"], z=None, dt_bias=a["dt_bias"],
              initial_states=a["initial_states"], return_intermediate_states=intermediate, seq_idx=a["seq_idx"],
              cu_seqlens=a["cu_seqlens"], cu_chunk_seqlens=a["cu_chunk_seqlens"], last_chunk_indices=last,
              dt_softplus=True, state_dtype=torch.float32)


def test_chunked_scan_matches_one_call_and_returns_every_chunk_end() -> None:
    from lw_vllm.cpu_fixes.mamba2_fix import chunked_scan

    scan = _scan()
    a = _inputs([70, 33, 128], chunk=32)
    whole_out = torch.zeros_like(a["x"])
    whole = _call(scan, a, whole_out, intermediate=False)
    assert whole.shape[0] == 3  # the CPU scan returns one state per sequence, whatever is asked

    out = torch.zeros_like(a["x"])
    states = _call(chunked_scan(scan), a, out, intermediate=True)
    nchunks = len(a["seq_idx"])
    assert states.shape[0] == nchunks
    torch.testing.assert_close(out, whole_out, rtol=1e-5, atol=1e-5)
    ends = [i for i in range(nchunks) if i + 1 == nchunks or a["seq_idx"][i + 1] != a["seq_idx"][i]]
    torch.testing.assert_close(states[ends], whole, rtol=1e-5, atol=1e-5)

    # A chunk's end state is the whole-call state of the sequence cut at that chunk's end.
    cut = {**a, "cu_seqlens": torch.tensor([0, 64], dtype=torch.int32), "x": a["x"][:64], "dt": a["dt"][:64],
           "B": a["B"][:64], "C": a["C"][:64], "initial_states": a["initial_states"][:1],
           "seq_idx": torch.tensor([0, 0], dtype=torch.int32), "cu_chunk_seqlens": torch.tensor([0, 32, 64], dtype=torch.int32)}
    torch.testing.assert_close(states[1:2], _call(scan, cut, torch.zeros_like(cut["x"]), intermediate=False),
                               rtol=1e-5, atol=1e-5)

    # Without intermediate states the call is the original one.
    plain = torch.zeros_like(a["x"])
    torch.testing.assert_close(_call(chunked_scan(scan), a, plain, intermediate=False), whole)


def test_checkpoint_store_writes_the_inputs_before_the_checkpoint_and_the_chunk_state() -> None:
    from lw_vllm.cpu_fixes.mamba2_fix import store_prefill_checkpoint

    dim, state_len, tokens = 6, 3, 20
    x = torch.arange(dim * tokens, dtype=torch.float32).reshape(dim, tokens)
    conv = torch.zeros(5, dim, state_len + 1)
    chunk_states = torch.randn(4, 2, 3)
    ssm = torch.zeros(5, 2, 3)
    meta = SimpleNamespace(checkpoint_offsets=torch.tensor([8, 0, 5]), state_indices=torch.tensor([1, 2, 4]))
    store_prefill_checkpoint(meta, torch.tensor([1, 0, 3]), x, conv, chunk_states, ssm,
                             torch.tensor([0, 10, 12]), state_len=state_len)
    torch.testing.assert_close(conv[1, :, :state_len], x[:, 5:8])
    torch.testing.assert_close(conv[4, :, :state_len], x[:, 14:17])
    assert conv[2].abs().sum() == 0 and conv[1, :, state_len].abs().sum() == 0  # no checkpoint: nothing written
    torch.testing.assert_close(ssm[1], chunk_states[1])
    torch.testing.assert_close(ssm[4], chunk_states[3])
    assert ssm[2].abs().sum() == 0 and ssm[0].abs().sum() == 0
