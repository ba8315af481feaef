"""Expected sizes of the pool's recurrent-state objects (lw_vllm.hybrid.state_layout) for the test models,
derived the way the engine sizes its state cache, so tests assert bytes moved without literals.

The SSM state's dtype is the running engine's, never assumed: vLLM 0.32's CPU platform stores a
gated delta-net state in float32 on CPUs with AVX512-BF16 and in the model's dtype elsewhere
(``CpuPlatform.check_and_update_config``), unless ``mamba_ssm_cache_dtype`` names one. Tests read it
from the connector's engine record (``ssm_dtype``) or force it, and size the state with it."""

from __future__ import annotations

import math
from typing import Any

from lw_bench.models import GDN_SPEC, MAMBA2_SPEC, hf_config


def state_group(engine: dict[str, Any]) -> dict[str, Any]:
    """The state group of an engine record (``lw_vllm.scheduler.engine_facts``; the test models have one)."""
    groups = [g for g in engine["groups"] if "dtypes" in g]
    if len(groups) != 1:
        raise AssertionError(f"expected one state group in the engine record, got {engine['groups']}")
    return groups[0]


def ssm_dtype(engine: dict[str, Any]) -> str:
    """The dtype the engine stores the SSM (temporal) state in: its state group's last tensor."""
    return str(state_group(engine)["dtypes"][-1])


def gdn_state_nbytes(spec: dict[str, Any] = GDN_SPEC, tp: int = 1, *, ssm_dtype: str) -> int:
    """Bytes of one boundary's state object of a ``qwen3_next`` spec: every linear-attention
    layer's convolution and recurrent state, one rank at TP ``tp``, from vLLM's own state shape and
    dtype calculators (``mamba_cache_dtype`` auto: the model's); ``ssm_dtype``: the recurrent
    state's, as the engine ran it."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    hf = hf_config(spec, 4096)
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(getattr(torch, spec["dtype"]), "auto", ssm_dtype)
    return _nbytes(shapes, dtypes) * hf.layer_types.count("linear_attention")


def mamba2_state_nbytes(spec: dict[str, Any] = MAMBA2_SPEC, tp: int = 1, *, ssm_dtype: str) -> int:
    """Bytes of one boundary's state object of a ``granitemoehybrid`` spec: every Mamba2 layer's
    convolution and SSM state, one rank at TP ``tp`` (vLLM's calculators, as for
    ``gdn_state_nbytes``)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    hf = hf_config(spec, 4096)
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp, hf.mamba_expand * hf.hidden_size, hf.mamba_n_groups, hf.mamba_n_heads, hf.mamba_d_head,
        hf.mamba_d_state, hf.mamba_d_conv)
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(getattr(torch, spec.get("dtype", "float32")), "auto",
                                                          ssm_dtype)
    return _nbytes(shapes, dtypes) * hf.layer_types.count("linear_attention")  # transformers names Mamba layers so


def _nbytes(shapes: Any, dtypes: Any) -> int:
    import torch

    return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes))
