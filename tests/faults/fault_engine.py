"""Run one in-process vLLM engine (CPU) with the pool backend wrapped in FaultyBackend.

    python tests/faults/fault_engine.py < job.json   ->  last stdout line: LW-FAULT-RESULT {...}

Test-owned: it monkeypatches ``lw_vllm.pool.open_backend`` before the LLM is built, so the
connector (scheduler and worker parts share one backend in an in-process engine) talks to the
wrapper. Job keys: ``model`` ("gqa" | "mla"), ``extra`` (kv_connector_extra_config), ``engine``
(extra LLM kwargs), ``max_tokens``, ``phases``: list of {"prompts": [[ids]...], "rules": [...],
"wipe_pool": bool}. Rules change at the start of each phase (a pool that fails, then recovers,
without restarting vLLM); ``wipe_pool`` closes the pool, deletes its directory and opens a new,
empty one under the same wrapper (a restarted pool that lost everything).
Per phase: outputs (tokens, top-2 logprobs, finish_reason, connector per-request stats), wall
time, how often each rule fired, and the connector's metrics from vLLM's Prometheus registry.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULT_MARK = "LW-FAULT-RESULT "


def _metrics(llm: Any) -> dict[str, float]:
    """Our connector metrics, summed over labels (histograms: their sample count and sum)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:lw_pool_"):
            continue
        if hasattr(m, "count"):
            out[m.name + ":count"] = out.get(m.name + ":count", 0) + m.count
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0.0) + m.sum
        else:
            out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0.0))
    return out


def _prompt(p: Any) -> dict[str, Any]:
    # A prompt is a list of token ids, or {"ids": [...], "salt": "tenant"} (vLLM's cache_salt).
    if isinstance(p, dict):
        return {"prompt_token_ids": p["ids"], "cache_salt": p["salt"]}
    return {"prompt_token_ids": p}


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    fd, stats_path = tempfile.mkstemp(prefix="lw-fault-stats-", suffix=".jsonl")
    os.close(fd)
    os.environ["LW_VLLM_STATS_FILE"] = stats_path

    from faulty_backend import FaultyBackend
    from lw_core import backend as core_backend
    from lw_vllm import pool
    from lw_vllm.testing.engine import _model_path, generate_phase

    wrappers: list[FaultyBackend] = []

    def open_faulty(cfg: Any, **kw: Any) -> FaultyBackend:
        w = FaultyBackend(core_backend.open_backend(cfg, **kw))
        w.cfg = cfg  # for wipe_pool
        wrappers.append(w)
        return w

    pool.open_backend = open_faulty

    from vllm import LLM, SamplingParams

    path, model_kw = _model_path(job["model"])
    kw: dict[str, Any] = dict(model=path, dtype="float32", enforce_eager=True, max_model_len=job.get("max_model_len", 1024),
                              kv_cache_memory_bytes=32 << 20, seed=0, disable_log_stats=False, **model_kw)
    kw["kv_transfer_config"] = {"kv_connector": "LayerwiseStoreConnector", "kv_role": job.get("kv_role", "kv_both"),
                                "kv_connector_extra_config": job["extra"]}
    kw.update(job.get("engine", {}))
    llm = LLM(**kw)
    assert len(wrappers) == 1, f"expected one shared pool backend, got {len(wrappers)}"
    fb = wrappers[0]
    sp = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), logprobs=2, ignore_eos=True)
    phases = []
    for i, ph in enumerate(job["phases"]):
        if ph.get("wipe_pool"):
            cfg = fb.cfg
            fb.inner.close()
            shutil.rmtree(cfg.embedded_path, ignore_errors=True)
            fb.inner = core_backend.open_backend(cfg)
        fb.phase = i
        fb.set_rules(ph.get("rules", []))
        res, wall = generate_phase(llm, [_prompt(p) for p in ph["prompts"]], sp, stats_path)
        phases.append({"outputs": res, "wall_s": wall, "rule_hits": list(fb.hits), "metrics": _metrics(llm),
                       "pool_objects": fb.inner.stats().get("objects")})
    os.unlink(stats_path)
    return {"phases": phases}


def main() -> None:
    out = run(json.loads(sys.stdin.read()))
    sys.stdout.write("\n" + RESULT_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # an in-process engine's shutdown can linger (stalled daemon threads included)


if __name__ == "__main__":
    main()
