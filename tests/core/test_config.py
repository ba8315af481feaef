import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw_core.backends.registry import backend_names
from lw_core.config import ConfigError, known_keys, parse_config


def test_defaults_follow_the_seed_table():
    cfg = parse_config({})
    assert cfg.use_layerwise is False
    assert cfg.backend == "embedded"
    assert cfg.mooncake_rpc_port == "0"
    assert cfg.layerwise_prefetch_layers == 1
    assert cfg.layerwise_max_transfer_blocks == 0
    assert cfg.layerwise_max_transfer_bytes == 0
    assert cfg.h2d_stagger_us == 0
    assert cfg.consumer_is_to_put is False and cfg.consumer_is_to_load is False
    # discard_partial_chunks: true in bulk mode, false in layerwise mode (the seed's table)
    assert cfg.discard_partial_chunks is True
    assert parse_config({"use_layerwise": True}).discard_partial_chunks is False
    assert parse_config({"use_layerwise": True, "discard_partial_chunks": True}).discard_partial_chunks is True


def test_seed_json_parses():
    cfg = parse_config({"backend": "memcache", "mooncake_rpc_port": "0", "use_layerwise": True})
    assert cfg.backend == "memcache" and cfg.use_layerwise


def test_rpc_port_alias_and_int():
    assert parse_config({"lookup_rpc_port": "5555"}).mooncake_rpc_port == "5555"
    assert parse_config({"mooncake_rpc_port": 6000}).mooncake_rpc_port == "6000"
    with pytest.raises(ConfigError, match="alias"):
        parse_config({"lookup_rpc_port": "1", "mooncake_rpc_port": "2"})


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"use_layerwsie": True}, ["use_layerwsie", "known keys", "use_layerwise"]),
        ({"h2d_stagger_us": "100"}, ["h2d_stagger_us", "'100'", "int"]),
        ({"h2d_stagger_us": -1}, ["h2d_stagger_us", "-1", ">= 0"]),
        ({"layerwise_max_transfer_bytes": -5}, ["layerwise_max_transfer_bytes", "-5"]),
        ({"layerwise_max_transfer_blocks": -1}, ["layerwise_max_transfer_blocks"]),
        ({"layerwise_prefetch_layers": 0}, ["layerwise_prefetch_layers", "0", ">= 1"]),
        ({"use_layerwise": "true"}, ["use_layerwise", "bool"]),
        ({"backend": "redis"}, ["backend", "'redis'", "unknown", "'embedded'"]),
        ({"backend": "yuanrong", "use_layerwise": True}, ["backend", "yuanrong", "layerwise", "'embedded'"]),
        ({"kv_load_failure_policy": "retry"}, ["kv_load_failure_policy", "'retry'", "'recompute'", "'fail'"]),
        ({"layer_wait_timeout_s": 0}, ["layer_wait_timeout_s", "> 0"]),
        ({"metaserver_timeout_s": math.inf}, ["metaserver_timeout_s"]),
        ({"embedded_capacity_bytes": 10}, ["embedded_capacity_bytes", "1 MiB"]),
        ({"mooncake_rpc_port": "http"}, ["mooncake_rpc_port", "'http'"]),
    ],
)
def test_bad_values_name_key_value_and_accepted(extra, words):
    with pytest.raises(ConfigError) as ei:
        parse_config(extra)
    for w in words:
        assert w in str(ei.value)


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(known_keys() + ["bogus", "backend_keys"]), _scalars, max_size=4))
def test_random_values_parse_or_fail_with_config_error(extra):
    # never any other exception type: vLLM start-up shows our message, not a traceback of ours
    try:
        cfg = parse_config(extra)
    except ConfigError as e:
        assert "kv_connector_extra_config" in str(e)
        return
    assert cfg.backend in backend_names() and cfg.backend_keys is not None
    assert cfg.layerwise_prefetch_layers >= 1
    assert 0 <= cfg.layerwise_max_transfer_bytes <= 1 << 40 and 0 <= cfg.layerwise_max_transfer_blocks <= 1 << 20
    assert cfg.layerwise_prefetch_layers <= 1024 and 0 < cfg.lookup_timeout_s <= 86400


@pytest.mark.parametrize(
    "key, value, accepted",
    [
        # values that parsed, then broke later
        ("layerwise_prefetch_layers", 2**70, "<= 1024"),
        ("layerwise_prefetch_layers", 1025, "<= 1024"),
        ("embedded_capacity_bytes", 2**64, "<= 17592186044416 (1 MiB to 16 TiB)"),
        ("layerwise_max_transfer_bytes", 2**41, "<= 1099511627776"),
        ("layerwise_max_transfer_blocks", 2**21, "<= 1048576"),
        ("h2d_stagger_us", 10**7, "<= 1000000"),
        ("layer_wait_timeout_s", 1e300, "<= 86400"),
        ("lookup_timeout_s", 86400.5, "<= 86400"),
        ("save_timeout_s", math.nan, "> 0"),
        ("metaserver_timeout_s", -1.0, "> 0"),
    ],
)
def test_numbers_are_bounded_and_the_error_names_the_range(key, value, accepted):
    with pytest.raises(ConfigError) as ei:
        parse_config({key: value})
    msg = str(ei.value)
    assert f"kv_connector_extra_config.{key}={value!r}" in msg and accepted in msg, msg


def test_upper_bounds_themselves_are_accepted():
    cfg = parse_config(
        {
            "layerwise_prefetch_layers": 1024,
            "embedded_capacity_bytes": 16 << 40,
            "layerwise_max_transfer_bytes": 1 << 40,
            "h2d_stagger_us": 1_000_000,
            "layer_wait_timeout_s": 86400,
        }
    )
    assert cfg.layerwise_prefetch_layers == 1024 and cfg.layer_wait_timeout_s == 86400.0


@pytest.mark.parametrize("path", ["", "/dev/shm/a\0b"])
def test_embedded_path_must_be_a_path(path):
    with pytest.raises(ConfigError, match="embedded_path"):
        parse_config({"embedded_path": path})
