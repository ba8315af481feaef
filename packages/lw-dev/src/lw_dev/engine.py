"""Run one vLLM engine (CPU) over phases of token prompts; used by the tests through a subprocess,
so every engine is a fresh process (as a second instance would be).

    python -m lw_dev.engine < job.json   ->  last stdout line: LW-ENGINE-RESULT {"phases": [...], ...}

Job keys: ``model`` ("gqa" | "mla" | "swa" | "gdn" | "mamba2" | a path; the last three are hybrids), ``phases``, ``max_tokens``, ``extra``
(kv_connector_extra_config, or null for no connector), ``kv_role``, ``connector``, ``engine``
(extra ``LLM(...)`` keyword arguments), ``max_model_len``, ``kv_cache_memory_bytes``, ``metrics``
(true: each phase also reports the connector's metrics and vLLM's preemptions so far).
A phase is a list of prompts run on the same engine one phase after another; a prompt is a list of
token ids or ``{"ids": [...], "salt": "tenant"}`` (vLLM's ``cache_salt``), ``{"ids": [...], "lora":
{"name": ..., "id": 1, "path": ...}}`` (a LoRA adapter; the engine needs ``enable_lora``) or
``{"embeds": seed, "n": tokens}`` (``prompt_embeds``: ``n`` random rows of the model's hidden size
drawn from ``seed``; the engine needs ``enable_prompt_embeds``). ``sampling``: ``SamplingParams``
keyword arguments replacing greedy decoding (e.g. ``{"temperature": 0.8, "seed": 1}``).
The result's ``engine``: the connector's engine record (``lw_vllm.scheduler.engine_facts``: block sizes, state
dtypes and bytes as vLLM decided them on this machine; ``None`` without a connector). Result per
prompt: generated token ids, per position the top-2 (token, logprob) pairs, the finish reason,
vLLM's cached-token count and the connector's per-request stats when a connector ran.

``"faults": true`` wraps the job's pool backend (default "embedded") in ``lw_dev.faulty_backend``
through lw-core's ``register_backend`` seam (plugin "faulty"), and a phase may then be
``{"prompts": [...], "rules": [...], "wipe_pool": bool}``: rules change at the start of each phase
(a pool that fails, then recovers, without restarting vLLM); ``wipe_pool`` closes the pool,
deletes its directory and opens a new, empty one under the same wrapper. Such phases also report
how often each rule fired (``rule_hits``), the connector's metrics from vLLM's Prometheus registry
(``metrics``) and the pool's object count (``pool_objects``). A rule's ``"objects": "state"`` picks
the engine's recurrent-state keys (this runner tells the wrapper the connector's state key space).
Any phase may be ``{"prompts": [...], "reset": true}``: vLLM's prefix-cache reset with the
connector's cache (``LLM.reset_prefix_cache(reset_connector=True)``) runs first, and the phase
reports what it returned (``reset_ok``). A phase ``{"reset_prefix_cache": true, ...}`` first empties
vLLM's own prefix cache only (its hits then come from the pool). ``"step_times": true``: each phase
also reports its engine steps' longest duration (``max_step_s``) and their count (``steps``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from lw_bench.engine_proc import emit, in_process_engine, main, read_engine, settle, stats_for

RESULT_MARK = "LW-ENGINE-RESULT "


def _model_path(name: str) -> tuple[str, dict[str, Any]]:
    from lw_bench import models

    if name == "gqa":
        return str(models.gqa_model()), {}
    if name == "mla":
        # The AMX MLA backend needs bf16 weights; the tiny models are float32.
        return str(models.mla_model()), {"attention_backend": "CPU_MLA"}
    if name == "swa":
        return str(models.swa_model()), {}
    if name == "gdn":
        # vLLM's CPU gated delta-net kernels run in bf16 only.
        return str(models.gdn_model()), {"dtype": "bfloat16"}
    if name == "mamba2":
        return str(models.mamba2_model()), {}
    return name, {}


def _prompt(p: Any, hidden_size: int) -> dict[str, Any]:
    if isinstance(p, dict) and "embeds" in p:
        import torch

        g = torch.Generator().manual_seed(int(p["embeds"]))
        return {"prompt_embeds": torch.randn(int(p["n"]), hidden_size, generator=g) * 0.5}
    if isinstance(p, dict):
        out: dict[str, Any] = {"prompt_token_ids": p["ids"]}
        if "salt" in p:
            out["cache_salt"] = p["salt"]
        return out
    return {"prompt_token_ids": p}


def _lora(p: Any) -> Any:
    if not (isinstance(p, dict) and "lora" in p):
        return None
    from vllm.lora.request import LoRARequest

    lo = p["lora"]
    return LoRARequest(lora_name=lo["name"], lora_int_id=int(lo["id"]), lora_path=lo["path"])


def _metrics(llm: Any) -> dict[str, float]:
    """Our connector metrics and vLLM's preemption count, summed over labels (histograms: their
    sample count and sum)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:lw_pool_") and m.name != "vllm:num_preemptions":
            continue
        if hasattr(m, "count"):
            out[m.name + ":count"] = out.get(m.name + ":count", 0) + m.count
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0.0) + m.sum
        else:
            out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0.0))
    return out


def _faulty_pool(extra: Any) -> tuple[dict[str, Any], list[Any], Any]:
    """Register plugin "faulty" wrapping ``extra``'s backend; returns the extra config selecting
    it, the list its wrappers land in, and the real plugin."""
    from lw_core.backends.registry import BackendPlugin, get_backend, register_backend
    from lw_dev.faulty_backend import FaultyBackend

    wrappers: list[Any] = []
    real = get_backend(extra.get("backend", "embedded"))

    def open_faulty(cfg: Any, **kw: Any) -> Any:
        w: Any = FaultyBackend(real.open(cfg, **kw))
        w.cfg = cfg  # for wipe_pool
        wrappers.append(w)
        return w

    register_backend("faulty", lambda: BackendPlugin(name="faulty", open=open_faulty, keys=real.keys, check=real.check))
    return {**extra, "backend": "faulty"}, wrappers, real


def _state_marks(llm: Any) -> tuple[str, ...]:
    """Substrings naming this engine's recurrent-state keys (its connector's state key space), if
    the pool restores its states."""
    from lw_vllm import pool
    from lw_vllm.hybrid import state_layout

    vc = llm.llm_engine.vllm_config
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # None: a multi-process engine core
    if core is None:
        return ()
    kc = core.scheduler.kv_cache_config
    if not pool.state_groups(kc) or state_layout.why_not_restorable(kc) is not None:
        return ()
    ks = state_layout.state_keyspace(pool.key_space(vc, kc, pool.pool_config(vc)), state_layout.state_layout(kc))
    return (f"/{ks.layout_fp}/",)


def _time_steps(llm: Any) -> list[float]:
    """Record every engine step's duration (in-process engine core) into the returned list."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("job step_times needs an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    inner = core.step_fn
    steps: list[float] = []

    def timed() -> Any:
        t = time.perf_counter()
        try:
            return inner()
        finally:
            steps.append(time.perf_counter() - t)

    core.step_fn = timed
    return steps


def run(job: dict[str, Any]) -> dict[str, Any]:
    stats_path = in_process_engine("lw-stats-", force=False)
    faults = bool(job.get("faults"))
    metrics = faults or bool(job.get("metrics"))  # each phase reports _metrics (cumulative)
    extra: Any = job.get("extra")
    wrappers: list[Any] = []
    real: Any = None
    if faults:
        extra, wrappers, real = _faulty_pool(extra)
    from vllm import LLM, SamplingParams

    path, model_kw = _model_path(job["model"])
    kw: dict[str, Any] = dict(
        model=path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 1024 if faults else 2048),
        kv_cache_memory_bytes=job.get("kv_cache_memory_bytes", 32 << 20),
        seed=0,
    )
    kw.update(model_kw)
    if metrics:
        kw["disable_log_stats"] = False  # the connector's metrics reach llm.get_metrics()
    if extra is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": job.get("connector", "LayerwiseStoreConnector"),
            "kv_role": job.get("kv_role", "kv_both"),
            "kv_connector_extra_config": extra,
        }
    kw.update(job.get("engine", {}))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    engine = read_engine(stats_path)  # the connector's engine record, before the phases empty the file
    if faults:
        assert len(wrappers) == 1, f"expected one shared pool backend, got {len(wrappers)}"
        wrappers[0].state_marks = _state_marks(llm)
    steps = _time_steps(llm) if job.get("step_times") else None
    sp = SamplingParams(**{"temperature": 0.0, **job.get("sampling", {})}, max_tokens=job.get("max_tokens", 8),
                        logprobs=2, ignore_eos=True)
    hidden = int(llm.llm_engine.model_config.get_hidden_size())
    phases = []
    for i, ph in enumerate(job["phases"]):
        ph = ph if isinstance(ph, dict) else {"prompts": ph}
        if faults:
            fb = wrappers[0]
            if ph.get("wipe_pool"):
                fb.inner.close()
                shutil.rmtree(fb.cfg.backend_keys.embedded_path, ignore_errors=True)
                fb.inner = real.open(fb.cfg)
            fb.phase = i
            fb.set_rules(ph.get("rules", []))
        reset_ok = llm.reset_prefix_cache(reset_connector=True) if ph.get("reset") else None
        if ph.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        if steps is not None:
            steps.clear()
        loras = [_lora(p) for p in ph["prompts"]]
        res, wall = generate_phase(llm, [_prompt(p, hidden) for p in ph["prompts"]], sp, stats_path,
                                   lora=loras if any(loras) else None)
        phase: dict[str, Any] = {"outputs": res, "wall_s": wall}
        if ph.get("reset"):
            phase["reset_ok"] = reset_ok
        if steps is not None:
            phase.update(max_step_s=max(steps, default=0.0), steps=len(steps))
        if metrics:
            phase["metrics"] = _metrics(llm)
        if faults:
            phase.update(rule_hits=list(fb.hits), pool_objects=fb.inner.stats().get("objects"))
        phases.append(phase)
    os.unlink(stats_path)
    return {"start_s": start_s, "engine": engine, "phases": phases}


def generate_phase(llm: Any, prompts: list[Any], sp: Any, stats_path: str,
                   lora: list[Any] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Generate ``prompts`` on ``llm``; per prompt the tokens, the top-2 (token, logprob) pairs per
    position, the finish reason, vLLM's cached-token count and the connector's stats line for it
    (``stats_path`` is the connector's LW_VLLM_STATS_FILE, emptied first). Also the wall time."""
    open(stats_path, "w").close()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora)
    wall = time.perf_counter() - t
    stats = settle(llm, stats_path, [o.request_id for o in outs])
    res = []
    for o in outs:
        c = o.outputs[0]
        top2 = [sorted(((tid, lp.logprob) for tid, lp in d.items()), key=lambda x: -x[1])[:2] for d in (c.logprobs or [])]
        res.append({
            "tokens": list(c.token_ids),
            "top2": top2,
            "finish_reason": c.finish_reason,
            "num_cached_tokens": o.num_cached_tokens,
            "stats": stats_for(stats, o.request_id),
        })
    return res, wall


def _main(job: dict[str, Any]) -> None:
    emit(RESULT_MARK + json.dumps(run(job)))


if __name__ == "__main__":
    main(_main)
