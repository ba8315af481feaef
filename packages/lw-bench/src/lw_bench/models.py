"""Tiny local models for tests and benchmarks: built here, never downloaded.

Random float32 weights from a transformers config plus a BPE tokenizer trained locally, saved
with ``save_pretrained`` so vLLM and transformers load them like any checkpoint. Built once and
cached under ``$LW_TEST_MODELS`` (default ``~/.cache/lw-test-models``) keyed by a hash of
everything that shapes the files, so config changes never reuse stale weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Bump when the build recipe changes in a way the spec hash cannot see.
_RECIPE = 2
VOCAB_SIZE = 512

# Random weights with transformers' default init (std 0.02) give nearly flat logits: greedy output
# would be a string of near-ties. A larger init spreads logits so that ties are rare.
_INIT_STD = 0.15

GQA_SPEC: dict[str, Any] = {
    "arch": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # vLLM's CPU attention kernels support head sizes 32, 64, 80, 96, 112, 128, 256 only.
    "head_dim": 32,
}

# vLLM's CPU MLA backend needs kv_lora_rank + qk_rope_head_dim == 576.
MLA_SPEC: dict[str, Any] = {
    "arch": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    # The CPU linear kernels refuse 16 input features: keep every projection width >= 32.
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}


# Sliding-window hybrid (Gemma 3 style): layers alternate sliding-window and full attention. The
# window (48 tokens) spans three 16-token blocks, so a hit past it leaves windowed blocks unread.
SWA_SPEC: dict[str, Any] = {
    "arch": "gemma3_text",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": 48,
}

# Linear-attention hybrid (Qwen3-Next style): gated delta-net layers with full attention every
# other layer, dense MLPs. vLLM's CPU GDN kernels need bf16, so the weights are bf16.
GDN_SPEC: dict[str, Any] = {
    "arch": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "dtype": "bfloat16",
}


# Mamba2 hybrid (Granite 4 / Nemotron-H style): Mamba2 layers with full attention every other
# layer, dense MLPs. float32 (vLLM's CPU Mamba2 kernels take it); prefix caching on the CPU needs
# lw_vllm.cpu_fixes.mamba2_fix.
MAMBA2_SPEC: dict[str, Any] = {
    "arch": "granitemoehybrid",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
}


def _corpus() -> list[str]:
    # Deterministic pseudo-text: enough variety for a few hundred merges.
    import random

    rng = random.Random(1234)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "dr", "st", "en", "or"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) + "." for _ in range(3000)]


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.model_max_length = 1 << 16
    fast.save_pretrained(out)


def hf_config(spec: dict[str, Any], max_len: int):  # the transformers config of a spec (lw_dev.state_sizes sizes states from it)
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        max_position_embeddings=max_len,
        initializer_range=_INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    if spec["arch"] == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"], **common)
    if spec["arch"] == "deepseek_v2":
        from transformers import DeepseekV2Config

        n = spec["num_hidden_layers"]
        return DeepseekV2Config(
            kv_lora_rank=spec["kv_lora_rank"],
            q_lora_rank=None,
            qk_rope_head_dim=spec["qk_rope_head_dim"],
            qk_nope_head_dim=spec["qk_nope_head_dim"],
            v_head_dim=spec["v_head_dim"],
            num_key_value_heads=spec["num_attention_heads"],
            # Dense MLP in every layer: MoE adds nothing to KV tests and slows CPU runs.
            first_k_dense_replace=n,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=spec["intermediate_size"],
            **common,
        )
    if spec["arch"] == "gemma3_text":
        from transformers import Gemma3TextConfig

        n = spec["num_hidden_layers"]
        return Gemma3TextConfig(
            num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
            sliding_window=spec["sliding_window"], query_pre_attn_scalar=spec["head_dim"],
            layer_types=["full_attention" if (i + 1) % spec.get("full_every", 2) == 0 else "sliding_attention"
                         for i in range(n)],
            pad_token_id=0, **common)
    if spec["arch"] == "qwen3_next":
        from transformers import Qwen3NextConfig

        n = spec["num_hidden_layers"]
        common["dtype"] = spec["dtype"]
        return Qwen3NextConfig(
            num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
            linear_num_key_heads=spec["linear_num_key_heads"], linear_num_value_heads=spec["linear_num_value_heads"],
            linear_key_head_dim=spec["linear_key_head_dim"], linear_value_head_dim=spec["linear_value_head_dim"],
            layer_types=["full_attention" if (i + 1) % spec.get("full_every", 2) == 0 else "linear_attention"
                         for i in range(n)],
            # Dense MLPs but in the last layer: vLLM's Qwen3-Next needs one MoE layer to start.
            mlp_only_layers=list(range(n - 1)), num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=spec["intermediate_size"], shared_expert_intermediate_size=spec["intermediate_size"],
            **common)
    if spec["arch"] == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig

        n = spec["num_hidden_layers"]
        common["dtype"] = spec.get("dtype", "float32")
        return GraniteMoeHybridConfig(
            num_key_value_heads=spec["num_key_value_heads"], mamba_n_heads=spec["mamba_n_heads"],
            mamba_d_head=spec["mamba_d_head"], mamba_d_state=spec["mamba_d_state"], mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=2, position_embedding_type="rope",
            layer_types=["attention" if (i + 1) % spec.get("full_every", 2) == 0 else "mamba" for i in range(n)],
            # Dense MLPs only (no experts): the shared MLP is the layer's MLP.
            num_local_experts=0, shared_intermediate_size=spec["intermediate_size"], pad_token_id=0, **common)
    raise ValueError(f"spec['arch']={spec['arch']!r}; accepted: 'llama', 'deepseek_v2', 'gemma3_text', 'qwen3_next', "
                     "'granitemoehybrid'")


def cache_root() -> Path:
    return Path(os.environ.get("LW_TEST_MODELS", Path.home() / ".cache" / "lw-test-models"))


def build_model(spec: dict[str, Any], *, max_len: int = 4096, seed: int = 0) -> Path:
    """Directory of a checkpoint for ``spec`` (built on first use, then cached)."""
    key = json.dumps({"spec": spec, "max_len": max_len, "seed": seed, "recipe": _RECIPE}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_root() / f"{spec['arch']}-{digest}"
    if (out / "done").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        torch.manual_seed(seed)
        cfg = hf_config(spec, max_len)
        dtype = torch.bfloat16 if spec.get("dtype") == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(tmp)
        _build_tokenizer(tmp)
        (tmp / "spec.json").write_text(key)
        (tmp / "done").write_text("ok\n")
        try:
            os.rename(tmp, out)  # atomic: a concurrent builder's result wins, ours is dropped
        except OSError:
            if not (out / "done").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gqa_model(**kw: Any) -> Path:
    return build_model(GQA_SPEC, **kw)


def mla_model(**kw: Any) -> Path:
    return build_model(MLA_SPEC, **kw)


def swa_model(**kw: Any) -> Path:
    return build_model(SWA_SPEC, **kw)


def gdn_model(**kw: Any) -> Path:
    return build_model(GDN_SPEC, **kw)


def mamba2_model(**kw: Any) -> Path:
    return build_model(MAMBA2_SPEC, **kw)


# ``lw-bench serve``: big enough that prefill compute dominates a 2k-token miss on a CPU, small
# enough to build in seconds (~134M parameters, 0.54 GB in float32). Not used by the tests.
BENCH_SPEC: dict[str, Any] = {
    "arch": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def bench_model(**kw: Any) -> Path:
    return build_model(BENCH_SPEC, **kw)


# ``lw-bench serve --model swa``: the bench model's size with Gemma 3's pattern (five
# sliding-window layers of 512 tokens to one full-attention layer).
BENCH_SWA_SPEC: dict[str, Any] = {
    **BENCH_SPEC,
    "arch": "gemma3_text",
    "sliding_window": 512,
    "full_every": 6,
}


# ``lw-bench serve --model gdn``: the bench model's size with Qwen3-Next's pattern (three gated
# delta-net layers to one full-attention layer), bf16 (vLLM's CPU GDN kernels need it).
BENCH_GDN_SPEC: dict[str, Any] = {
    **BENCH_SPEC,
    "arch": "qwen3_next",
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "dtype": "bfloat16",
    "full_every": 4,
}


def lora_adapter(out: Path, *, seed: int, rank: int = 8, spec: dict[str, Any] = GQA_SPEC) -> Path:
    """A PEFT LoRA adapter for ``spec``'s model in ``out`` (random ``lora_A``/``lora_B`` on q/k/v/o,
    large enough to move the KV). Written fresh each call; the caller owns ``out``."""
    import torch
    from safetensors.torch import save_file

    if spec["arch"] != "llama":
        raise ValueError(f"spec['arch']={spec['arch']!r}; accepted: 'llama'")
    g = torch.Generator().manual_seed(seed)
    h, d = spec["hidden_size"], spec["head_dim"]
    outs = {"q_proj": spec["num_attention_heads"] * d, "k_proj": spec["num_key_value_heads"] * d,
            "v_proj": spec["num_key_value_heads"] * d, "o_proj": h}
    ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": spec["num_attention_heads"] * d}
    tensors: dict[str, Any] = {}
    for layer in range(spec["num_hidden_layers"]):
        for m, n_out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, ins[m], generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.3
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(outs), "base_model_name_or_path": None,
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }))
    return out
