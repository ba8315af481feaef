"""The model fingerprint in pool keys is the model's identity (config and weights' content, or the
operator's ``model_id``), not its path (lw_vllm.model_identity, pool.key_space). Cheap: no engine."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from lw_core.config import ConfigError, parse_config
from lw_vllm import model_identity as mi
from lw_vllm import pool


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mi.CACHE_ENV, str(tmp_path / "digests"))
    monkeypatch.setattr(mi, "_memo", {})


def _model(d: Path, weights: bytes = b"W" * 1000, config: str = '{"hidden_size": 8}') -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(config)
    (d / "model.safetensors").write_bytes(weights)
    (d / "tokenizer.json").write_text("{}")
    return d


def _keyspace(model: str, **extra: object):
    spec = SimpleNamespace(block_size=16, page_size_bytes=4096)
    kc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    vc = SimpleNamespace(model_config=SimpleNamespace(model=model, dtype="float32", revision=None, use_mla=False),
                         cache_config=SimpleNamespace(cache_dtype="auto"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return pool.key_space(vc, kc, parse_config({"embedded_path": "/dev/shm/unused", **extra}))


def test_same_weights_at_two_paths_share_keys(tmp_path: Path) -> None:
    a = _model(tmp_path / "host-a" / "llama")
    b = tmp_path / "mnt" / "models" / "copy"
    shutil.copytree(a, b)
    assert _keyspace(str(a)) == _keyspace(str(b))
    # The tokenizer does not change the KV of token ids: not part of the identity.
    (b / "tokenizer.json").write_text('{"x": 1}')
    assert _keyspace(str(a)) == _keyspace(str(b))


def test_other_weights_or_config_at_the_same_path_do_not(tmp_path: Path) -> None:
    p = _model(tmp_path / "m")
    before = _keyspace(str(p))
    # Same size, same header-like start: a fine-tune. Only the content tells them apart.
    (p / "model.safetensors").write_bytes(b"W" * 999 + b"X")
    after = _keyspace(str(p))
    assert after.model_fp != before.model_fp and after.layout_fp == before.layout_fp
    (p / "config.json").write_text('{"hidden_size": 8, "rope_theta": 5}')
    assert _keyspace(str(p)).model_fp not in (before.model_fp, after.model_fp)


def test_digest_is_cached_on_disk_by_path_size_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _model(tmp_path / "m")
    first = mi.local_identity(str(p))
    monkeypatch.setattr(mi, "_memo", {})  # a new process: only the disk cache is left
    reads: list[Path] = []
    real_open = open

    def counting_open(path, *a, **k):
        if str(path).endswith(".safetensors"):
            reads.append(Path(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", counting_open)
    assert mi.local_identity(str(p)) == first and reads == []
    assert len(list((tmp_path / "digests").iterdir())) == 1


def test_model_id_overrides_and_names_without_files(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    b = _model(tmp_path / "b", weights=b"other")
    # The operator vouches that these are the same model.
    assert _keyspace(str(a), model_id="llama-3-8b@v2") == _keyspace(str(b), model_id="llama-3-8b@v2")
    assert _keyspace(str(a), model_id="llama-3-8b@v2") != _keyspace(str(a))
    # A hub name vLLM downloads itself: the name (and revision) is the identity.
    assert _keyspace("org/model") == _keyspace("org/model") != _keyspace("org/model2")


@pytest.mark.parametrize("bad", ["", " x", "a b", "x" * 201, 5, "-lead"])
def test_model_id_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"model_id=.*accepted: .*letters, digits"):
        parse_config({"model_id": bad})
