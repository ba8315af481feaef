"""The connector's metrics show in vLLM's own /metrics: a real OpenAI server (tiny GQA model, CPU,
127.0.0.1, free port; engine core in its own process, so the stats cross vLLM's process boundary),
one request that saves, one that hits, then a scrape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from lw_dev.harness import pool_dir
from lw_dev.harness import random_tokens as toks
from lw_dev.ports import free_port

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

pytestmark = pytest.mark.slow

START_DEADLINE_S = 300


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture
def server():
    from lw_bench import models

    model = str(models.gqa_model())
    port = free_port()
    pool = pool_dir()
    ktc = {"kv_connector": "LayerwiseStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"embedded_path": pool, "embedded_capacity_bytes": 64 << 20,
                                         "use_layerwise": True}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
           "--kv-cache-memory-bytes", str(32 << 20), "--block-size", "32", "--no-enable-prefix-caching",
           "--kv-transfer-config", json.dumps(ktc)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if _get(base + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"vLLM server not healthy within {START_DEADLINE_S} s:\n{log.read()[-4000:]}")
            time.sleep(1)
        yield base, model, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine core it started
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
        import shutil

        shutil.rmtree(pool, ignore_errors=True)


def _values(text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]


def test_connector_metrics_in_vllm_metrics_after_a_hit(server) -> None:
    base, model, log = server
    prompt = toks(21, 100)  # 3 full chunks
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = _post(base + "/v1/completions", body)
    second = _post(base + "/v1/completions", body)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]

    deadline = time.monotonic() + 30  # the front end records stats as engine outputs arrive
    while True:
        status, text = _get(base + "/metrics")
        assert status == 200
        if sum(_values(text, "vllm:lw_pool_loaded_bytes_total")) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    got = {n: sum(_values(text, n)) for n in (
        "vllm:lw_pool_lookups_total", "vllm:lw_pool_lookup_tokens_total", "vllm:lw_pool_hit_tokens_total",
        "vllm:lw_pool_loaded_objects_total", "vllm:lw_pool_loaded_bytes_total", "vllm:lw_pool_saved_objects_total",
        "vllm:lw_pool_saved_bytes_total", "vllm:lw_pool_layer_wait_seconds_count",
        "vllm:lw_pool_load_failed_blocks_total")}
    assert got["vllm:lw_pool_lookups_total"] >= 2, got
    assert got["vllm:lw_pool_lookup_tokens_total"] >= 200, got
    assert got["vllm:lw_pool_hit_tokens_total"] == 96, got
    assert got["vllm:lw_pool_loaded_objects_total"] == 3 and got["vllm:lw_pool_saved_objects_total"] == 3, got
    assert got["vllm:lw_pool_loaded_bytes_total"] == got["vllm:lw_pool_saved_bytes_total"] > 0, got
    assert got["vllm:lw_pool_layer_wait_seconds_count"] >= 4, got  # one sample per layer of the loading step
    assert got["vllm:lw_pool_load_failed_blocks_total"] == 0, got
    # Every metric carries vLLM's engine labels and documents itself.
    assert "# HELP vllm:lw_pool_hit_tokens_total" in text
    assert any(line.startswith("vllm:lw_pool_hit_tokens_total{") and 'engine="0"' in line for line in text.splitlines())
