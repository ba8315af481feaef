"""What a request adds to its keys besides token ids (lw_vllm.request.request_keys). Cheap: no engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lw_core.keys import chunk_hashes, partial_chunk_hash
from lw_vllm.identity import model_identity as mi
from lw_vllm.request import request_keys as rk


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mi.CACHE_ENV, str(tmp_path / "digests"))
    monkeypatch.setattr(mi, "_memo", {})


def _adapter(d: Path, weights: bytes) -> str:
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


def _lora(name: str, path: str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path)


def _req(ids: list[int] | None = None, embeds: torch.Tensor | None = None, lora: object = None) -> SimpleNamespace:
    n = len(ids) if ids is not None else int(embeds.shape[0])  # type: ignore[union-attr]
    return SimpleNamespace(prompt_token_ids=ids, prompt_embeds=embeds, num_prompt_tokens=n,
                           all_token_ids=list(ids) if ids is not None else [0] * n, lora_request=lora,
                           cache_salt=None, mm_features=None)


def test_lora_is_keyed_by_adapter_content_not_name(tmp_path: Path) -> None:
    a = _adapter(tmp_path / "a", b"A" * 100)
    b = _adapter(tmp_path / "b", b"B" * 100)
    a_copy = _adapter(tmp_path / "elsewhere" / "a", b"A" * 100)
    ident = rk.lora_identity
    assert ident(_lora("x", a)) != ident(_lora("x", b))  # a name re-pointed at another adapter
    assert ident(_lora("x", a)) == ident(_lora("y", a_copy))  # one adapter under two names and paths
    before = ident(_lora("x", a))
    (Path(a) / "adapter_model.safetensors").write_bytes(b"A" * 99 + b"Z")  # rewritten in place
    assert ident(_lora("x", a)) != before
    # Not on this machine (vLLM resolves it itself): name and path, as vLLM's block hash.
    assert ident(_lora("x", "org/adapter")) != ident(_lora("x", "org/other"))
    assert ident(None) is None
    toks = list(range(64))
    ha = chunk_hashes(toks, 16, rk.hash_extra(_req(toks, lora=_lora("x", a))))
    hb = chunk_hashes(toks, 16, rk.hash_extra(_req(toks, lora=_lora("x", b))))
    assert not set(ha) & set(hb)


def test_embeddings_enter_each_chunk_and_the_partial_one() -> None:
    g = torch.Generator().manual_seed(0)
    e1 = torch.randn(40, 8, generator=g)
    e2 = e1.clone()
    e2[20] += 1.0  # differs in chunk 1 (rows 16..31) only
    r1, r2 = _req(embeds=e1), _req(embeds=e2)
    d1, d2 = rk.input_digests(r1, 16), rk.input_digests(r2, 16)
    assert len(d1) == 3  # two full chunks, one partial
    toks = rk.prompt_tokens(r1)
    assert toks == [0] * 40 == rk.prompt_tokens(r2)  # what vLLM leaves in the ids
    h1, h2 = chunk_hashes(toks, 16, None, d1), chunk_hashes(toks, 16, None, d2)
    assert h1[0] == h2[0] and h1[1] != h2[1]
    assert chunk_hashes(toks, 16) != h1  # not the all-zeros prompt's keys
    e3 = e1.clone()
    e3[35] -= 1.0  # only the trailing partial chunk differs
    d3 = rk.input_digests(_req(embeds=e3), 16)
    assert chunk_hashes(toks, 16, None, d3) == h1
    assert (partial_chunk_hash(toks, 16, "p", None, chunk_digests=d1)
            != partial_chunk_hash(toks, 16, "p", None, chunk_digests=d3))
    # dtype is part of the digest: the same bytes read as another dtype are other inputs
    assert rk.input_digests(_req(embeds=e1.view(torch.int32)), 16) != d1
    # Generated tokens after the prompt carry no digest: their ids are real.
    assert chunk_hashes(toks + list(range(100, 124)), 16, None, d1)[:2] == h1


def test_token_prompts_are_unchanged() -> None:
    r = _req(list(range(50)))
    assert rk.input_digests(r, 16) == ()
    assert rk.prompt_tokens(r) == list(range(50)) and rk.num_prompt_tokens(r) == 50
