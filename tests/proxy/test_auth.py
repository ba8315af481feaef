"""Auth: admin endpoints need the key (refused without one unless enabled),
metaserver callbacks carry their parent's token when a key is set, the Bearer scheme in any case,
no credential in /metrics, no backend URL for callers without the key (/metrics refused,
/healthcheck bare), keys from a file or the environment."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest
from raw_http import exchange, head

from lw_core.wire import DecodeTransferParams
from lw_dev.proxy_mocks import METASERVER_OK, harness, run
from lw_proxy.config import ProxyConfig, parse_args
from lw_proxy.validate import parse_completion
from lw_vllm.pd.pd_metaserver import MetaserverClient

OK = METASERVER_OK  # a 200 answer (it may carry the prefill's first token)


def test_admin_endpoint_is_refused_without_a_key_unless_enabled():
    async def body():
        async with harness() as h:
            s, out = await h.post("/reset_prefix_cache", None)
            assert s == 403 and out["error"]["type"] == "permission_error"
            assert "--allow-unauthenticated-admin" in out["error"]["message"]
            assert [b.resets for b in h.prefillers + h.decoders] == [0, 0]
        async with harness(allow_unauthenticated_admin=True) as h:
            s, _ = await h.post("/reset_prefix_cache", None)
            assert s == 200 and [b.resets for b in h.prefillers + h.decoders] == [1, 1]

    run(body())


def test_bearer_scheme_is_case_insensitive_and_the_key_is_not():
    async def body():
        async with harness(api_key="Sekret") as h:
            for header, want in [("bearer Sekret", 200), ("BEARER  Sekret", 200), ("Bearer sekret", 401),
                                 ("Basic Sekret", 401), ("Sekret", 401)]:
                s, _ = await h.post("/reset_prefix_cache", None, headers={"Authorization": header})
                assert s == want, header
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1},
                                headers={"Authorization": "bearer Sekret"})
            assert s == 200

    run(body())


@pytest.mark.parametrize("mode", ["early", "on-metaserver"])
def test_metaserver_needs_the_parents_token_when_a_key_is_set(mode):
    async def body():
        async with harness(continue_after_prefill=False, api_key="k", prefill_dispatch=mode) as h:
            auth = {"Authorization": "Bearer k"}
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1}, headers=auth)
            assert s == 200 and h.decoders[0].metaserver_results == [OK]
            token = h.decoders[0].bodies[0]["kv_transfer_params"]["lw_token"]
            assert len(token) >= 32

            h.decoders[0].knobs.send_token = False  # an older connector: clear 401, the decoder recomputes
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1}, headers=auth)
            assert s == 200
            ms, err = h.decoders[0].metaserver_results[-1]
            assert ms == 401 and "upgrade its lw-vllm connector" in err["error"]["message"]
            # on-metaserver: no prefill for an unauthenticated callback; early: the authenticated
            # client request dispatched it, and the callback gets nothing from it
            assert len(h.prefillers[0].bodies) == (2 if mode == "early" else 1)

            parent = h.proxy.registry.open(1, parse_completion(b'{"prompt": "x"}'))
            body = {"lw_parent_id": parent.id, "request_id": "r"}
            s, _ = await h.post("/v1/metaserver", body, headers={"Authorization": "Bearer " + "x" * 32})
            assert s == 401
            s, _ = await h.post("/v1/metaserver", body, headers=auth)  # the key itself also authenticates
            assert s == 200
            h.proxy.registry.close(parent)

    run(body())


def test_metaserver_stays_open_without_a_key_but_refuses_a_wrong_token():
    async def body():
        async with harness(continue_after_prefill=False) as h:
            h.decoders[0].knobs.send_token = False
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1})
            assert s == 200 and h.decoders[0].metaserver_results == [OK]
            parent = h.proxy.registry.open(1, parse_completion(b'{"prompt": "x"}'))
            s, _ = await h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": "r"},
                                headers={"Authorization": "Bearer wrong"})
            assert s == 401
            h.proxy.registry.close(parent)

    run(body())


def test_the_decoders_metaserver_client_sends_the_token():
    async def body():
        async with harness(api_key="k") as h:
            client = MetaserverClient(timeout_s=5.0)
            try:
                outcomes = {}
                for name, token in (("with", True), ("without", False)):
                    parent = h.proxy.registry.open(1, parse_completion(b'{"prompt": "x"}'))
                    params = DecodeTransferParams(metaserver=h.metaserver_url, lw_parent_id=parent.id,
                                                  lw_token=parent.token if token else None)
                    client.post(f"req-{name}", params)
                    deadline = time.monotonic() + 10
                    while (out := client.poll(f"req-{name}")) is None:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.01)
                    outcomes[name] = out
                    h.proxy.registry.close(parent)
            finally:
                await asyncio.to_thread(client.close)
            assert outcomes["with"].ok, outcomes["with"].detail
            assert not outcomes["without"].ok and "401" in outcomes["without"].detail

    run(body())


def test_no_credential_leaks_into_metrics_healthcheck_or_repr():
    async def body():
        async with harness(continue_after_prefill=False, api_key="client-key-123", backend_api_key="backend-key-456") as h:
            auth = {"Authorization": "Bearer client-key-123"}
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1}, headers=auth)
            assert s == 200
            async with h.session.get(h.url + "/metrics", headers=auth) as r:
                assert r.status == 200
                metrics = await r.text()
            async with h.session.get(h.url + "/healthcheck", headers=auth) as r:
                health = await r.text()
            token = h.decoders[0].bodies[0]["kv_transfer_params"]["lw_token"]
            for secret in ("client-key-123", "backend-key-456", token):
                assert secret not in metrics and secret not in health
            assert "key-" not in repr(h.proxy.cfg)

    run(body())


def test_without_the_key_no_backend_url_is_shown():
    async def body():
        async with harness(api_key="k") as h:
            urls = [*h.proxy.cfg.prefillers, *h.proxy.cfg.decoders]
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1}, headers={"Authorization": "Bearer k"})
            assert s == 200  # the backends now have samples in /metrics
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with h.session.get(h.url + "/metrics", headers=headers) as r:
                    text = await r.text()
                    assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
                async with h.session.get(h.url + "/healthcheck", headers=headers) as r:
                    health = await r.json()
                    assert r.status == 200  # liveness stays open: status and counts
                assert health["status"] == "ok" and health["backends"] == []
                assert health["prefill_instances"] == health["healthy_decode_instances"] == 1
                for url in urls:
                    assert url.split("//", 1)[1] not in text + json.dumps(health)
            auth = {"Authorization": "Bearer k"}
            async with h.session.get(h.url + "/metrics", headers=auth) as r:
                text = await r.text()
                assert r.status == 200 and all(u in text for u in urls)
            async with h.session.get(h.url + "/healthcheck", headers=auth) as r:
                assert sorted(b["url"] for b in (await r.json())["backends"]) == sorted(urls)
        async with harness() as h:  # no key: nothing to protect, details for everyone
            async with h.session.get(h.url + "/metrics") as r:
                assert r.status == 200
            async with h.session.get(h.url + "/healthcheck") as r:
                assert len((await r.json())["backends"]) == 2

    run(body())


def test_keys_from_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    f = tmp_path / "key"
    f.write_text("from-file\n")
    f.chmod(0o600)
    cfg, _ = parse_args(["--api-key-file", str(f), "--backend-api-key-file", str(f)])
    assert cfg.api_key == cfg.backend_api_key == "from-file"
    assert capsys.readouterr().err == ""

    monkeypatch.setenv("LW_PROXY_API_KEY", "from-env")
    cfg, _ = parse_args([])
    assert cfg.api_key == "from-env" and capsys.readouterr().err == ""

    cfg, _ = parse_args(["--api-key", "on-cmdline"])
    assert cfg.api_key == "on-cmdline"
    assert "visible in the process list" in capsys.readouterr().err

    f.chmod(0o644)
    parse_args(["--api-key-file", str(f)])
    assert "readable by other users" in capsys.readouterr().err
    assert ProxyConfig().allow_unauthenticated_admin is False


@pytest.mark.parametrize("argv,text", [
    (["--api-key-file", "/nonexistent/key"], "--api-key-file: cannot read"),
    (["--api-key", "a", "--api-key-file", "/x"], "--api-key and --api-key-file are both given"),
])
def test_bad_key_flags_are_refused(argv, text, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert text in capsys.readouterr().err


def test_empty_key_file_is_refused(tmp_path, capsys):
    f = tmp_path / "empty"
    f.write_text("\n")
    os.chmod(f, 0o600)
    with pytest.raises(SystemExit):
        parse_args(["--backend-api-key-file", str(f)])
    assert "--backend-api-key-file" in capsys.readouterr().err


def test_a_bearer_token_that_is_not_utf8_is_a_401_like_any_wrong_key():
    async def body():
        async with harness(api_key="k") as h:
            for path, payload in (("/v1/completions", b'{"prompt": "p", "max_tokens": 1}'),
                                  ("/reset_prefix_cache", b"{}"),
                                  ("/v1/metaserver", b'{"lw_parent_id": "x", "request_id": "r"}')):
                raw = head(path, length=len(payload))[:-2] + b"Authorization: Bearer \xff\xfek\r\n\r\n"
                status, out = await exchange(h.url, [raw + payload])
                assert status == 401 and out["error"]["type"] == "authentication_error", (path, status, out)
            metrics = h.proxy.m.render()[0].decode()
            assert 'lw_proxy_errors_total{kind="client_disconnect"}' not in metrics
            assert 'lw_proxy_requests_total{endpoint="/v1/completions",status="401"} 1.0' in metrics
            assert not h.decoders[0].bodies

    run(body())


@pytest.mark.parametrize("argv,env,text", [
    (["--api-key", ""], None, "--api-key: the key is empty, which would turn authentication off"),
    ([], "", "env LW_PROXY_API_KEY: the key is empty"),  # LW_PROXY_API_KEY="$UNSET_VARIABLE"
    (["--api-key", "k\n"], None, "--api-key: the key has leading or trailing whitespace"),
    ([], " k", "env LW_PROXY_API_KEY: the key has leading or trailing whitespace"),
    (["--backend-api-key", ""], None, "--backend-api-key: the key is empty"),
])
def test_an_empty_or_padded_key_is_refused_at_start(argv, env, text, monkeypatch, capsys):
    if env is not None:
        monkeypatch.setenv("LW_PROXY_API_KEY", env)
    with pytest.raises(SystemExit) as ei:
        parse_args(argv)
    assert ei.value.code == 2 and text in capsys.readouterr().err
    with pytest.raises(ValueError, match="api_key: is empty"):
        ProxyConfig(api_key="")
    with pytest.raises(ValueError, match="backend_api_key: has leading or trailing whitespace"):
        ProxyConfig(backend_api_key="k\n")


def test_start_up_says_whether_auth_is_on(caplog):
    from lw_proxy.cli import log_auth

    with caplog.at_level(logging.INFO, logger="lw_proxy"):
        log_auth(ProxyConfig(api_key="secret-1"))
        log_auth(ProxyConfig())
    on, backend_none, off, _ = caplog.records
    assert on.getMessage().startswith("client auth: on") and on.levelno == logging.INFO
    assert off.getMessage().startswith("client auth: off") and off.levelno == logging.WARNING
    assert "/reset_prefix_cache is refused" in off.getMessage()
    assert backend_none.getMessage().startswith("backend auth: none sent")
    assert "secret-1" not in caplog.text
