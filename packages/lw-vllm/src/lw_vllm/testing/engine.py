"""Run one vLLM engine (CPU, in-process core) over phases of token prompts; used by tests and the
bench through a subprocess, so every engine is a fresh process (as a second instance would be).

    python -m lw_vllm.testing.engine < job.json   ->  last stdout line: {"phases": [...], ...}

Job keys: ``model`` ("gqa" | "mla" | a path), ``phases`` (list of lists of token-id prompts, run
one after another on the same engine), ``max_tokens``, ``extra`` (kv_connector_extra_config, or
null for no connector), ``kv_role``, ``engine`` (extra ``LLM(...)`` keyword arguments).
Result per prompt: generated token ids, per position the top-2 (token, logprob) pairs, and the
connector's per-request stats (promised/loaded tokens) when a connector ran.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

RESULT_MARK = "LW-ENGINE-RESULT "


def _model_path(name: str) -> tuple[str, dict[str, Any]]:
    from lw_vllm.testing import models

    if name == "gqa":
        return str(models.gqa_model()), {}
    if name == "mla":
        # The AMX MLA backend needs bf16 weights; the tiny models are float32.
        return str(models.mla_model()), {"attention_backend": "CPU_MLA"}
    return name, {}


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    stats_fd, stats_path = tempfile.mkstemp(prefix="lw-stats-", suffix=".jsonl")
    os.close(stats_fd)
    os.environ["LW_VLLM_STATS_FILE"] = stats_path
    from vllm import LLM, SamplingParams

    path, model_kw = _model_path(job["model"])
    kw: dict[str, Any] = dict(
        model=path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 2048),
        kv_cache_memory_bytes=job.get("kv_cache_memory_bytes", 32 << 20),
        seed=0,
        **model_kw,
    )
    if job.get("extra") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": job.get("connector", "LayerwiseStoreConnector"),
            "kv_role": job.get("kv_role", "kv_both"),
            "kv_connector_extra_config": job["extra"],
        }
    kw.update(job.get("engine", {}))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), logprobs=2, ignore_eos=True)
    phases = []
    for prompts in job["phases"]:
        res, wall = generate_phase(llm, [{"prompt_token_ids": p} for p in prompts], sp, stats_path)
        phases.append({"outputs": res, "wall_s": wall})
    os.unlink(stats_path)
    return {"start_s": start_s, "phases": phases}


def generate_phase(llm: Any, prompts: list[Any], sp: Any, stats_path: str) -> tuple[list[dict[str, Any]], float]:
    """Generate ``prompts`` on ``llm``; per prompt the tokens, the top-2 (token, logprob) pairs per
    position, the finish reason, vLLM's cached-token count and the connector's stats line for it
    (``stats_path`` is the connector's LW_VLLM_STATS_FILE, emptied first). Also the wall time."""
    open(stats_path, "w").close()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    stats: dict[str, Any] = {}
    with open(stats_path) as f:
        for line in f:
            rec = json.loads(line)
            stats[rec["req_id"]] = rec
    res = []
    for o in outs:
        c = o.outputs[0]
        top2 = [sorted(((tid, lp.logprob) for tid, lp in d.items()), key=lambda x: -x[1])[:2] for d in (c.logprobs or [])]
        res.append({
            "tokens": list(c.token_ids),
            "top2": top2,
            "finish_reason": c.finish_reason,
            "num_cached_tokens": o.num_cached_tokens,
            "stats": _stats_for(stats, o.request_id),
        })
    return res, wall


def _stats_for(stats: dict[str, Any], request_id: str) -> Any:
    # vLLM's engine core appends a random suffix to the caller's request id.
    if request_id in stats:
        return stats[request_id]
    for rid, rec in stats.items():
        if rid.startswith(request_id + "-"):
            return rec
    return None


def main() -> None:
    job = json.loads(sys.stdin.read())
    out = run(job)
    sys.stdout.write("\n" + RESULT_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    # vLLM's shutdown of an in-process engine can linger; the result is out already.
    os._exit(0)


if __name__ == "__main__":
    main()
