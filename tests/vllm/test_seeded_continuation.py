"""A seeded request continuing an answered prefill gets its generator one draw ahead
(lw_vllm.pd.seeded_continuation): the draw consumes exactly what one sampling step of vLLM's own
sampler consumes, whatever the logits, top-k or top-p, on each of the sampler's paths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import vllm._custom_ops  # noqa: F401 - loads the CPU sampler's fused kernel (torch.ops._C), as an engine does
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

from lw_vllm.pd import seeded_continuation as sc

VOCAB = 97


def _runner(sampler: TopKTopPSampler, **kw) -> SimpleNamespace:
    return SimpleNamespace(input_batch=SimpleNamespace(vocab_size=VOCAB), device=torch.device("cpu"),
                           sampler=SimpleNamespace(topk_topp_sampler=sampler), requests={}, **kw)


@pytest.mark.parametrize("path", ["cpu", "native", "fp64"])
def test_the_draw_consumes_what_a_sampling_step_consumes(path: str) -> None:
    sampler = TopKTopPSampler(use_fp64_gumbel=path == "fp64")
    if path == "native":  # the CUDA path with per-request generators
        sampler.forward = sampler.forward_native
    stepped, advanced = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    # A real step: three rows, this request's the second, with top-k and top-p.
    logits = torch.randn(3, VOCAB)
    sampler(logits, {1: stepped}, torch.tensor([5, 7, 9]), torch.tensor([0.9, 0.8, 0.95]))
    sc.advance(_runner(sampler), advanced)
    assert torch.equal(stepped.get_state(), advanced.get_state())
    assert not torch.equal(advanced.get_state(), torch.Generator().manual_seed(5).get_state())  # it moved


def _new(req_id: str, kv: dict | None) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": kv}
                                                                          if kv is not None else None))


def test_only_new_seeded_requests_that_continue_a_prefill_are_advanced() -> None:
    runner = _runner(TopKTopPSampler())
    fresh = torch.Generator().manual_seed(1).get_state()
    for rid in ("cont", "plain", "decoder-path"):
        runner.requests[rid] = SimpleNamespace(generator=torch.Generator().manual_seed(1))
    runner.requests["unseeded"] = SimpleNamespace(generator=None)
    out = SimpleNamespace(scheduled_new_reqs=[_new("cont", {"lw_prefilled": 1}), _new("plain", None),
                                              _new("decoder-path", {"lw_prefilled": 0, "do_remote_prefill": True}),
                                              _new("unseeded", {"lw_prefilled": 1})])
    assert sc.advance_new(runner, out) == 1
    moved = {rid for rid, st in runner.requests.items() if st.generator is not None
             and not torch.equal(st.generator.get_state(), fresh)}
    assert moved == {"cont"}


def test_speculative_decoding_leaves_the_generator_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    runner = _runner(TopKTopPSampler(), speculative_config=object())
    runner.requests["cont"] = SimpleNamespace(generator=torch.Generator().manual_seed(1))
    out = SimpleNamespace(scheduled_new_reqs=[_new("cont", {"lw_prefilled": 1})] * 2)
    with caplog.at_level("WARNING"):
        assert sc.advance_new(runner, out) == 0
    assert [r.message for r in caplog.records].count(
        "lw-vllm: with speculative decoding, a seeded request continued after its prefill draws other tokens "
        "than a single engine (same distribution)") == 1


def test_apply_wraps_the_model_runner_once() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert sc.apply() and sc.apply()
    wrapped = GPUModelRunner._update_states
    assert getattr(wrapped, "_lw_seeded_continuation", False) and not getattr(
        wrapped.__wrapped__, "_lw_seeded_continuation", False)
