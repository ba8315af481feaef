"""The model fingerprint in pool keys is the model's identity (config and weights' content, or the
operator's ``model_id``), not its path (lw_vllm.identity.model_identity, pool.key_space). Cheap: no engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from lw_core.config import ConfigError, parse_config
from lw_vllm import pool
from lw_vllm.identity import model_identity as mi


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


class _HfConfig:
    """What vLLM resolved: config.json, then ``--hf-overrides``, plus where it came from."""

    def __init__(self, model: str, overrides: dict | None = None) -> None:
        f = Path(model) / "config.json"
        self.d = {**(json.loads(f.read_text()) if f.is_file() else {}), **(overrides or {}),
                  "_name_or_path": model, "transformers_version": "4.99"}

    def to_dict(self) -> dict:
        return dict(self.d)


def _vllm_config(model: str, *, overrides: dict | None = None, quantization: str | None = None,
                 load_format: str = "auto", revision: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, dtype="float32", revision=revision, use_mla=False,
                                     hf_config=_HfConfig(model, overrides), quantization=quantization),
        load_config=SimpleNamespace(load_format=load_format),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))


def _keyspace(model: str, *, engine: dict | None = None, **extra: object):
    spec = SimpleNamespace(block_size=16, page_size_bytes=4096)
    kc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    vc = _vllm_config(model, **(engine or {}))
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
    # A hub name with no local snapshot: the name and revision are all there is.
    assert _keyspace("org/model") == _keyspace("org/model") != _keyspace("org/model2")
    assert _keyspace("org/model", engine={"revision": "v1"}) != _keyspace("org/model")


def test_engine_settings_that_change_the_kv_change_the_model_fingerprint(tmp_path: Path) -> None:
    p = str(_model(tmp_path / "m"))
    base = _keyspace(p)
    assert _keyspace(p) == base  # deterministic; the config's path and library version are no part of it
    fps = {
        base.model_fp,
        _keyspace(p, engine={"overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}}).model_fp,
        _keyspace(p, engine={"quantization": "fp8"}).model_fp,
        _keyspace(p, engine={"load_format": "dummy"}).model_fp,
    }
    assert len(fps) == 4
    # The config as resolved: a --hf-config-path config differing from the weights' folder's counts.
    other_cfg = _model(tmp_path / "cfg", config='{"hidden_size": 8, "rope_theta": 1e6}')
    vc = _vllm_config(p)
    vc.model_config.hf_config = _HfConfig(str(other_cfg))
    from lw_vllm.identity.engine_identity import engine_identity

    assert engine_identity(vc, None).config != engine_identity(_vllm_config(p), None).config
    assert engine_identity(vc, None).weights == engine_identity(_vllm_config(p), None).weights
    # model_id vouches for the weights only: engine settings still separate keys.
    assert _keyspace(p, model_id="m1", engine={"quantization": "fp8"}) != _keyspace(p, model_id="m1")


def test_weights_outside_the_suffix_list_are_identified_by_content(tmp_path: Path) -> None:
    d = tmp_path / "tensorized"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.tensors").write_bytes(b"T" * 100)
    first = _keyspace(str(d))
    assert mi.local_identity(str(d)) is not None
    (d / "model.tensors").write_bytes(b"T" * 99 + b"U")
    assert _keyspace(str(d)).model_fp != first.model_fp
    # Sharded into a sub-folder (no weights file at the top).
    s = tmp_path / "sharded"
    (s / "shards").mkdir(parents=True)
    (s / "config.json").write_text('{"hidden_size": 8}')
    (s / "shards" / "0.bin.part").write_bytes(b"A" * 10)
    (s / ".git").mkdir()
    (s / ".git" / "HEAD").write_text("ref")
    one = mi.local_identity(str(s))
    (s / ".git" / "HEAD").write_text("other")  # hidden files are not the model
    assert mi.local_identity(str(s)) == one
    (s / "shards" / "0.bin.part").write_bytes(b"B" * 10)
    assert mi.local_identity(str(s)) != one


def test_a_hub_id_is_identified_by_the_snapshot_vllm_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snaps = {"c1": _model(tmp_path / "snapshots" / "c1"), "c2": _model(tmp_path / "snapshots" / "c2", weights=b"new")}
    current = {"rev": "c1"}
    monkeypatch.setattr(mi, "hub_snapshot", lambda model, revision: str(snaps[current["rev"]]) if model == "org/m" else None)
    at_c1 = _keyspace("org/m")
    current["rev"] = "c2"  # `main` moved on: another snapshot, other weights
    assert _keyspace("org/m").model_fp != at_c1.model_fp
    assert mi.model_identity("org/m").startswith("content:")


@pytest.mark.parametrize("bad", ["", " x", "a b", "x" * 201, 5, "-lead"])
def test_model_id_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"model_id=.*accepted: .*letters, digits"):
        parse_config({"model_id": bad})
