"""Processes for the PD tests and ``lw-bench pd``: vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``)
with LayerwiseStoreConnector, ``lw-proxy``, all on 127.0.0.1 free ports, each in its own process
group so a teardown kills the engine core and workers too. Every wait has a deadline; a process
that dies or does not come up raises with the tail of its log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp.test_utils import unused_port

from lw_bench.engine_proc import read_engine

# vLLM's API server imports for ~1-2 min on a loaded 2-core machine.
SERVER_START_TIMEOUT_S = 420.0
PROXY_START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0

# No chat template ships with the tiny local models.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def free_port() -> int:
    return unused_port()


def http(method: str, url: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post_json(url: str, body: Any, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    status, raw = http("POST", url, body, timeout)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def post_sse(url: str, body: Any, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, list[Any]]:
    """POST a streaming request; the decoded ``data:`` payloads ("[DONE]" kept as a string)."""
    status, raw = http("POST", url, body, timeout)
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return status, events


def metric_sum(base_url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples over all label sets (0 when absent); ``name`` may name
    one label set (``name{label="value"}``)."""
    return metric_sums(base_url, [name])[name]


def metric_sums(base_url: str, names: list[str]) -> dict[str, float]:
    """``metric_sum`` of each of ``names`` from one scrape."""
    status, raw = http("GET", base_url + "/metrics", timeout=30)
    assert status == 200, f"{base_url}/metrics answered {status}"
    lines = raw.decode().splitlines()
    out = {}
    for name in names:
        pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$")
        out[name] = sum(float(m.group(2)) for line in lines if (m := pat.match(line)))
    return out


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        # Its own process group (start_new_session): the API server, its engine core and workers.
        pgid = self.popen.pid
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # vLLM's children may outlive the leader for a moment after SIGTERM.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _spawn(name: str, argv: list[str], env: dict[str, str], log_dir: Path, url: str,
           launcher: Sequence[str] = ()) -> Proc:
    """``launcher``: an argv prefix that runs the process elsewhere, e.g. ``ip netns exec HOST``."""
    log_path = log_dir / f"{name}.log"
    f = open(log_path, "wb")
    p = subprocess.Popen([*launcher, *argv], stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    f.close()
    return Proc(name, p, log_path, url)


def wait_ready(procs: list[Proc], path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode} while starting:\n{p.log_tail()}")
            try:
                status, _ = http("GET", p.url + path, timeout=5)
            except OSError:
                status = 0
            if status == 200:
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"{[p.name for p in pending]} not ready within {timeout_s:g} s:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)


@dataclass
class VllmServer:
    proc: Proc
    stats_path: Path
    block_size: int
    _stats_mark: int = field(default=0)

    @property
    def url(self) -> str:
        return self.proc.url

    def mark(self) -> None:
        """Remember the stats file's end: ``new_stats`` returns records written after it."""
        self._stats_mark = self.stats_path.stat().st_size if self.stats_path.exists() else 0

    def new_stats(self) -> list[dict[str, Any]]:
        """The per-request records written since ``mark`` (not the engine record)."""
        if not self.stats_path.exists():
            return []
        with open(self.stats_path, "rb") as f:
            f.seek(self._stats_mark)
            recs = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
        return [r for r in recs if "engine" not in r]

    def engine(self) -> dict[str, Any]:
        """The connector's engine record (lw_vllm.scheduler.engine_facts): what vLLM decided on this machine
        (block sizes, state dtypes and bytes), written at start-up."""
        found = read_engine(str(self.stats_path)) if self.stats_path.exists() else None
        if found is None:
            raise RuntimeError(f"{self.proc.name}: no engine record in {self.stats_path}")
        return found


def start_vllm(name: str, model_dir: str, *, kv_role: str, extra: dict[str, Any], cpu: str, log_dir: Path,
               block_size: int, mla: bool, max_model_len: int = 1024, kv_cache_bytes: int = 32 << 20,
               host: str = "127.0.0.1", launcher: Sequence[str] = (), port: int | None = None,
               env_extra: dict[str, str] | None = None, dtype: str = "float32",
               prefix_caching: bool = False, tools: bool = False, reasoning_parser: str | None = None) -> VllmServer:
    """``host``/``launcher``/``port``: bind another address, started through ``launcher`` (another
    host's network namespace, where this process cannot pick a free port: pass one). ``env_extra``:
    more environment for the server (e.g. ``PYTHONPATH``). ``prefix_caching``: vLLM's prefix cache
    (a gated delta-net hybrid saves its states only with it on). ``tools``: tool calling on (auto
    tool choice, the ``pythonic`` parser; a server with a parser streams a chat's empty-text token
    as an event with an empty delta, or none, where one without sends empty content).
    ``reasoning_parser``: vLLM's ``--reasoning-parser`` (one that reads text, such as ``granite``:
    the tiny tokenizer has no think tokens)."""
    port = port or free_port()
    stats = log_dir / f"{name}-stats.jsonl"
    template = log_dir / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", host, "--port", str(port), "--model", model_dir, "--served-model-name", "tiny",
        "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes",
        str(kv_cache_bytes), "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", "--seed", "0",
        "--chat-template", str(template),
        "--kv-transfer-config", json.dumps({"kv_connector": "LayerwiseStoreConnector", "kv_role": kv_role,
                                            "kv_connector_extra_config": extra}),
    ]
    if tools:  # a tool parser vLLM ships that needs no special tokens (vLLM serves a named tool choice only with one)
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    if reasoning_parser:
        argv += ["--reasoning-parser", reasoning_parser]
    if mla:
        argv += ["--attention-backend", "CPU_MLA"]  # the AMX MLA backend needs bf16 weights
    else:
        argv += ["--block-size", str(block_size)]
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes sizes the cache
    env.update({"VLLM_CPU_OMP_THREADS_BIND": cpu, "LW_VLLM_STATS_FILE": str(stats), "PYTHONUNBUFFERED": "1"})
    env.update(env_extra or {})
    proc = _spawn(name, argv, env, log_dir, f"http://{host}:{port}", launcher)
    return VllmServer(proc, stats, block_size)


def start_proxy(name: str, prefill_url: str, decode_url: str, log_dir: Path, *extra: str,
                host: str = "127.0.0.1", launcher: Sequence[str] = (), port: int | None = None) -> Proc:
    """``host`` is also the address decoders call back (``/v1/metaserver``)."""
    port = port or free_port()
    p_host, p_port = prefill_url.rsplit("/", 1)[-1].rsplit(":", 1)
    d_host, d_port = decode_url.rsplit("/", 1)[-1].rsplit(":", 1)
    lw_proxy = Path(sys.executable).with_name("lw-proxy")
    argv = [str(lw_proxy), "--host", host, "--port", str(port),
            "--prefiller-hosts", p_host, "--prefiller-ports", p_port,
            "--decoder-hosts", d_host, "--decoder-ports", d_port, *extra]
    proc = _spawn(name, argv, dict(os.environ), log_dir, f"http://{host}:{port}", launcher)
    wait_ready([proc], "/metrics", PROXY_START_TIMEOUT_S)
    return proc


def cpu_ids() -> tuple[str, str]:
    """Two CPU ids for the two engines' OpenMP threads (the same one twice on a 1-CPU machine)."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[0]), str(cpus[1 % len(cpus)])


@dataclass
class Stack:
    """One 1P1D set-up: prefiller, decoder, lw-proxy (more proxies may be added by tests)."""

    prefill: VllmServer
    decode: VllmServer
    proxy: Proc
    log_dir: Path
    block_size: int
    metaserver_timeout_s: float
    extra_procs: list[Proc] = field(default_factory=list)

    def add_proxy(self, name: str, prefill_url: str, decode_url: str, *flags: str) -> Proc:
        p = start_proxy(name, prefill_url, decode_url, self.log_dir, *flags)
        self.extra_procs.append(p)
        return p

    def stop(self) -> None:
        for p in [*self.extra_procs, self.proxy, self.prefill.proc, self.decode.proc]:
            if p is not None:
                p.stop()


def start_stack(model: str, log_dir: Path, pool_path: str, *, metaserver_timeout_s: float,
                extra: dict[str, Any] | None = None, max_model_len: int = 1024,
                kv_cache_bytes: int = 32 << 20, block_size: int | None = None,
                proxy_flags: Sequence[str] = (), tools: bool = False, reasoning_parser: str | None = None) -> Stack:
    """Start prefiller and decoder at once (start-up is mostly imports), warm both up with a chat
    and a completion straight at them, then the proxy (given ``proxy_flags`` too). First uses are slow (lazy imports; the
    first request asking for log-probs took ~5 s on the CPU build), so warm-ups use every feature
    the tests use."""
    from lw_bench import models

    mla = model == "mla"
    # swa: the sliding-window hybrid, run with vLLM's hybrid KV cache manager (its blocks are 32).
    # gdn: the gated delta-net hybrid, bf16 (vLLM's CPU GDN kernels), prefix caching on so vLLM hands
    # its states off at block boundaries ("align" mode), asked for blocks of 256 tokens (a page then
    # holds a layer's state whichever dtype vLLM's CPU platform stores it in: float32 with
    # AVX512-BF16, bf16 without). mamba2: the Mamba2 hybrid, float32, prefix caching on likewise,
    # blocks of 128. vLLM may still raise a hybrid's block: the stack's block_size is the one the
    # engines report (their connector's engine record, lw_vllm.scheduler.engine_facts).
    model_dir = str({"mla": models.mla_model, "swa": models.swa_model, "gdn": models.gdn_model,
                     "mamba2": models.mamba2_model}.get(model, models.gqa_model)())
    state_block = {"gdn": 256, "mamba2": 128}.get(model)
    block = 16 if mla else (block_size or state_block or 32)  # vLLM's CPU MLA backend forces 16
    dtype = "bfloat16" if model == "gdn" else "float32"
    prefix_caching = state_block is not None
    extra = {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True,
             "metaserver_timeout_s": metaserver_timeout_s, **(extra or {})}
    c0, c1 = cpu_ids()
    prefill = start_vllm("prefill", model_dir, kv_role="kv_producer", extra=extra, cpu=c0, log_dir=log_dir,
                         block_size=block, mla=mla, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                         dtype=dtype, prefix_caching=prefix_caching, tools=tools, reasoning_parser=reasoning_parser)
    decode = proxy = None
    try:
        decode = start_vllm("decode", model_dir, kv_role="kv_consumer", extra=extra, cpu=c1, log_dir=log_dir,
                            block_size=block, mla=mla, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                            dtype=dtype, prefix_caching=prefix_caching, tools=tools,
                            reasoning_parser=reasoning_parser)
        wait_ready([prefill.proc, decode.proc], "/health", SERVER_START_TIMEOUT_S)
        blocks = {s.proc.name: s.engine()["block_size"] for s in (prefill, decode)}
        if len(set(blocks.values())) != 1:
            raise RuntimeError(f"the engines run blocks of different sizes: {blocks}")
        block = prefill.block_size = decode.block_size = blocks["prefill"]
        for s in (prefill, decode):
            for path, body in (("/v1/completions", {"prompt": "warm up", "logprobs": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}],
                                                         "logprobs": True, "top_logprobs": 2})):
                status, out = post_json(s.url + path, {"model": "tiny", "max_tokens": 2, **body})
                assert status == 200, f"warm-up {path} on {s.proc.name}: {status} {out}"
        proxy = start_proxy("proxy", prefill.url, decode.url, log_dir,
                            "--metaserver-timeout", str(metaserver_timeout_s * 2), *proxy_flags)
        # One PD round trip of several chunks: the first save, load and metaserver call pay
        # one-time costs (threads, imports, connections) that tests should not time.
        status, out = post_json(proxy.url + "/v1/completions",
                                {"model": "tiny", "prompt": "ka lo mi ne ru " * 30, "max_tokens": 2, "logprobs": 2})
        assert status == 200, f"PD warm-up through the proxy: {status} {out}"
    except BaseException:
        for p in (proxy, prefill.proc, decode.proc if decode is not None else None):
            if p is not None:
                p.stop()
        raise
    return Stack(prefill, decode, proxy, log_dir, block, metaserver_timeout_s)
