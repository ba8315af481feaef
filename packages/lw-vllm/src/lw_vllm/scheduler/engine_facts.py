"""What vLLM decided for this engine that the pool's byte counts depend on: the stats file's engine
record (``request_stats.StatsLog.engine``), written once at start-up.

Several of these are the CPU's choice, not the user's: vLLM 0.32's CPU platform stores a gated
delta-net model's recurrent state in float32 when the CPU has AVX512-BF16 and in the model's dtype
otherwise (unless ``--mamba-ssm-cache-dtype`` names one), and raises a hybrid's attention block
until a page holds a layer's state (128 or 256 tokens for the same model, by that dtype). Readers
(lw-bench, the tests) take them from here instead of assuming a machine:

* ``block_size``: the pool's chunk, in tokens (the anchor attention group's block);
* ``dtype``: the model's; ``kv_cache_dtype`` and ``mamba_ssm_cache_dtype``: the cache config's
  after vLLM's platform adjusted it (``auto``: the model's);
* ``groups``: per KV cache group, its spec's kind (``FullAttentionSpec``, ``MambaSpec``, ...),
  layer count, block size and page bytes; a state group also its tensors' shapes and dtypes (one
  block's row) and ``mamba_cache_mode``;
* ``state_bytes``: one boundary's state object (every state layer, this rank), ``None`` when the
  pool keeps no states for this model.
"""

from __future__ import annotations

from typing import Any

from lw_vllm import pool
from lw_vllm.hybrid import state_layout


def engine_facts(vllm_config: Any, kv_cache_config: Any, layout: state_layout.StateLayout | None) -> dict[str, Any]:
    cc = vllm_config.cache_config
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        row: dict[str, Any] = {"kind": type(spec).__name__, "layers": len(g.layer_names),
                               "block_size": int(spec.block_size), "page_size_bytes": int(spec.page_size_bytes)}
        if pool.is_state_spec(spec):
            row["shapes"] = [[int(n) for n in s] for s in spec.shapes]
            row["dtypes"] = [state_layout.dtype_name(d) for d in spec.dtypes]
            row["mamba_cache_mode"] = str(getattr(spec, "mamba_cache_mode", "none"))
        elif getattr(spec, "dtype", None) is not None:
            row["dtype"] = state_layout.dtype_name(spec.dtype)
        groups.append(row)
    return {
        "block_size": pool.block_size(kv_cache_config),
        "dtype": state_layout.dtype_name(vllm_config.model_config.dtype),
        "kv_cache_dtype": str(getattr(cc, "cache_dtype", "auto")),
        "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "auto")),
        "groups": groups,
        "state_bytes": None if layout is None else layout.nbytes,
    }
