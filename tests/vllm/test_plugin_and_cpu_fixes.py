"""The plugin's registration rules, the CPU RoPE fix for MLA checked against transformers, and the CPU
fix for seeded requests with chunked prefills."""

from __future__ import annotations

import random

import pytest

from lw_dev.harness import run_engine
from lw_vllm import plugin
from lw_vllm.cpu_fixes import rope_fix


class _Factory:
    def __init__(self) -> None:
        self._registry: dict[str, tuple] = {}

    def register_connector(self, name: str, module: str, cls: str) -> None:
        if name in self._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        self._registry[name] = (module, cls)


def test_register_is_idempotent_and_never_takes_an_existing_name() -> None:
    f = _Factory()
    f.register_connector("AscendStoreConnector", "vllm_ascend.x", "AscendStoreConnector")
    assert plugin._register(f, plugin.CONNECTOR_NAME)
    assert not plugin._register(f, plugin.CONNECTOR_NAME)  # second process-wide call: no error
    assert not plugin._register(f, plugin.ALIAS_NAME)
    assert f._registry["AscendStoreConnector"] == ("vllm_ascend.x", "AscendStoreConnector")
    assert f._registry[plugin.CONNECTOR_NAME] == ("lw_vllm.connector", "LayerwiseStoreConnector")


def test_plugin_registers_both_names_with_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    plugin.register()
    plugin.register()
    from lw_vllm.connector import LayerwiseStoreConnector

    for name in (plugin.CONNECTOR_NAME, plugin.ALIAS_NAME):
        assert KVConnectorFactory.get_connector_class_by_name(name) is LayerwiseStoreConnector
    assert LayerwiseStoreConnector.requires_piecewise_for_cudagraph({"use_layerwise": True})
    assert not LayerwiseStoreConnector.requires_piecewise_for_cudagraph({})


@pytest.mark.slow
def test_mla_first_token_matches_transformers_only_with_the_fix() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lw_bench.models import mla_model

    r = random.Random(7)
    prompt = [r.randrange(3, 500) for _ in range(70)]
    m = AutoModelForCausalLM.from_pretrained(mla_model(), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(m(torch.tensor([prompt])).logits[0, -1].double(), -1)
    job = {"model": "mla", "max_tokens": 1, "extra": None, "phases": [[prompt]]}

    def first(env: dict) -> tuple[int, float]:
        o = run_engine(job, env=env)["phases"][0]["outputs"][0]
        return o["tokens"][0], o["top2"][0][0][1]

    tok, lp = first({"LW_VLLM_ROPE_FIX": "1"})
    assert tok == int(ref.argmax()) and abs(lp - float(ref[tok])) < 1e-3, (tok, lp, int(ref.argmax()), float(ref.max()))
    import vllm

    if vllm.__version__.startswith(rope_fix.AFFECTED_VERSIONS):
        # Without the fix this vLLM is measurably wrong: the test above can fail.
        tok0, lp0 = first({"LW_VLLM_ROPE_FIX": "0"})
        assert tok0 != tok or abs(lp0 - float(ref[tok0])) > 1e-2, (tok0, lp0)


SEEDED = {"temperature": 0.8, "seed": 1}


@pytest.mark.slow
def test_seeded_chunked_prefill_runs_and_matches_the_unchunked_run_only_with_the_fix() -> None:
    """A seeded request whose prefill is chunked killed vLLM 0.32's CPU engine ("CPU Generator does
    not use offset"); with the fix it runs, and its sampled tokens equal the unchunked run's (the
    discarded chunk samples leave no trace, as CUDA's rewind)."""
    from lw_dev.harness import EngineFailed, random_tokens
    from lw_vllm.cpu_fixes import seed_fix

    prompt = random_tokens(21, 300)
    job = {"model": "gqa", "max_tokens": 8, "extra": None, "sampling": SEEDED, "phases": [[prompt]]}
    chunked = {**job, "engine": {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}}
    whole = {**job, "engine": {"max_num_batched_tokens": 2048}}
    got = run_engine(chunked, env={"LW_VLLM_SEED_FIX": "1"})["phases"][0]["outputs"][0]["tokens"]
    ref = run_engine(whole, env={"LW_VLLM_SEED_FIX": "1"})["phases"][0]["outputs"][0]["tokens"]
    assert got == ref and len(got) == 8
    import vllm

    if vllm.__version__.startswith(seed_fix.AFFECTED_VERSIONS):
        with pytest.raises(EngineFailed, match="CPU Generator does not use offset"):
            run_engine(chunked, env={"LW_VLLM_SEED_FIX": "0"})
