"""Expected sizes of the pool's recurrent-state objects (lw_vllm.hybrid.state_layout) for the test models,
derived the way the engine sizes its state cache, so tests assert bytes moved without literals."""

from __future__ import annotations

import math
from typing import Any

from lw_bench.models import GDN_SPEC, hf_config


def gdn_state_nbytes(spec: dict[str, Any] = GDN_SPEC, tp: int = 1, ssm_dtype: str = "float32") -> int:
    """Bytes of one boundary's state object of a ``qwen3_next`` spec: every linear-attention
    layer's convolution and recurrent state, one rank at TP ``tp``, from vLLM's own state shape and
    dtype calculators (``mamba_cache_dtype`` auto: the model's dtype). ``ssm_dtype``: the recurrent
    state's, which vLLM's CPU platform sets to float32 when left auto (``CpuPlatform
    .check_and_update_config``: "Reset SSM cache type to float32")."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator

    hf = hf_config(spec, 4096)
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(getattr(torch, spec["dtype"]), "auto", ssm_dtype)
    per_layer = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes))
    return per_layer * hf.layer_types.count("linear_attention")
