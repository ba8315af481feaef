"""Backends as plugins: ``register_backend`` in-process, entry points, strict keys of each plugin,
and the errors for unknown, refused and known-but-missing backends."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import pytest

from lw_core.backends import registry
from lw_core.backends.builtin import MEMORY
from lw_core.backends.memory import MemoryBackend
from lw_core.backends.registry import BackendPlugin, UnknownBackend, open_backend, register_backend, unregister_backend
from lw_core.config import ConfigError, known_keys, parse_config


class ToyKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    toy_slots: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4


def _toy_plugin() -> BackendPlugin:
    return BackendPlugin(
        name="toy",
        open=lambda cfg, **kw: MemoryBackend(cfg.backend_keys.toy_slots << 20, **kw),
        keys=ToyKeys,
        notes={"toy_slots": "MiB"},
    )


@pytest.fixture
def toy():
    register_backend("toy", _toy_plugin)
    yield
    unregister_backend("toy")


def test_registered_backend_is_opened_with_its_own_keys(toy):
    cfg = parse_config({"backend": "toy", "toy_slots": 2})
    assert cfg.backend_keys == ToyKeys(toy_slots=2)
    b = open_backend(cfg, lease_ttl_s=5.0)
    try:
        assert isinstance(b, MemoryBackend) and b.capacity == 2 << 20 and b.lease_ttl_s == 5.0
    finally:
        b.close()
    assert "toy_slots" in known_keys()


def test_plugin_keys_are_strict_with_the_same_clear_errors(toy):
    with pytest.raises(ConfigError) as ei:
        parse_config({"backend": "toy", "toy_slots": 65})
    assert str(ei.value) == "kv_connector_extra_config.toy_slots=65 is not accepted; accepted: an integer >= 1 and <= 64 (MiB)"
    with pytest.raises(ConfigError, match="toy_slots='2'.*an integer"):
        parse_config({"backend": "toy", "toy_slots": "2"})


def test_keys_of_an_unregistered_backend_are_unknown():
    with pytest.raises(ConfigError, match="unknown key.*'toy_slots'"):
        parse_config({"toy_slots": 2})


def test_keys_of_another_installed_backend_are_checked_and_ignored(toy):
    cfg = parse_config({"toy_slots": 3})  # the default backend (embedded) is selected
    assert cfg.backend == "embedded" and not hasattr(cfg.backend_keys, "toy_slots")
    with pytest.raises(ConfigError, match="toy_slots=0"):
        parse_config({"toy_slots": 0})


def test_unknown_backend_names_the_installed_ones(toy):
    with pytest.raises(ConfigError) as ei:
        parse_config({"backend": "redis"})
    msg = str(ei.value)
    assert "backend='redis' is unknown" in msg and "'embedded'" in msg and "'toy'" in msg, msg


def test_known_missing_backend_says_what_to_install(monkeypatch):
    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points", lambda: {k: v for k, v in real().items() if k != "memcache"})
    monkeypatch.setattr(registry, "_loaded", {})
    with pytest.raises(ConfigError) as ei:
        parse_config({"backend": "memcache"})
    assert "pip install 'lw-memcache[store]'" in str(ei.value) and "'embedded'" in str(ei.value)
    with pytest.raises(UnknownBackend, match="lw-memcache"):
        registry.get_backend("memcache")


def test_refused_name_keeps_its_reason_unless_a_plugin_provides_it():
    with pytest.raises(ConfigError, match="Yuanrong is not supported"):
        parse_config({"backend": "yuanrong"})
    register_backend("yuanrong", lambda: BackendPlugin(name="yuanrong", open=MEMORY.open))
    try:
        assert parse_config({"backend": "yuanrong"}).backend == "yuanrong"
    finally:
        unregister_backend("yuanrong")


def test_loader_by_module_path_and_bad_loaders():
    register_backend("memory", "lw_core.backends.builtin:MEMORY")
    try:
        b = open_backend(parse_config({"backend": "memory"}))
        assert isinstance(b, MemoryBackend)
        b.close()
    finally:
        unregister_backend("memory")
    register_backend("liar", lambda: MEMORY)  # a plugin that calls itself "memory"
    try:
        with pytest.raises(ConfigError, match="registered as .liar. calls itself .memory."):
            parse_config({"backend": "liar"})
    finally:
        unregister_backend("liar")
    with pytest.raises(ValueError, match="name"):
        register_backend("", lambda: MEMORY)


def test_embedded_and_memcache_come_from_entry_points():
    eps: dict[str, Any] = {ep.name: ep.value for ep in registry.entry_points(group=registry.GROUP)}
    assert eps.get("embedded") == "lw_core.backends.builtin:EMBEDDED"
    assert eps.get("memcache") == "lw_memcache.plugin:PLUGIN"

