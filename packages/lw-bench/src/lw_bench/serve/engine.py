"""One engine of ``lw-bench serve``, run as a fresh process so every mode starts cold and a pool
hit can only come from the pool (never from an earlier engine's memory).

    python -m lw_bench.serve.engine < job.json

Job keys: ``model`` (checkpoint directory), ``dtype``, ``block_size``, ``max_model_len``,
``kv_cache_memory_bytes``, ``prefix_caching``, ``extra`` (kv_connector_extra_config, or null for
no connector), ``engine`` (more ``LLM(...)`` keyword arguments, optional), ``metrics`` (optional:
report the connector's pool counters at the end) and ``items``: ``[{"id": str, "tokens": [int, ...]}, ...]`` run one at a time, in
order, each as its own ``generate`` call with ``max_tokens=1`` so the call's wall time is the
request's time to first token.

stdout: a line ``LW-SERVE-STARTED <seconds>`` once the engine is up, with a connector then
``LW-SERVE-ENGINE <json>`` (its engine record, lw_vllm.scheduler.engine_facts: the block and state dtypes vLLM
ran on this machine), ``LW-SERVE-ITEM <json>`` per
item (``id``, ``ttft_s``, ``cached_tokens`` as vLLM reports them, ``pool`` = the connector's
per-request stats or null), with ``metrics``: ``LW-SERVE-METRICS <json>`` (the engine's
``vllm:lw_pool_*`` counters without that prefix, e.g. ``disk_hits``, ``disk_read_bytes``), and
``LW-SERVE-DONE`` at the end; everything else is vLLM's log.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from lw_bench.engine_proc import emit, in_process_engine, main, read_engine, settle, stats_for

STARTED = "LW-SERVE-STARTED "
ITEM = "LW-SERVE-ITEM "
DONE = "LW-SERVE-DONE"
METRICS = "LW-SERVE-METRICS "
ENGINE = "LW-SERVE-ENGINE "
_PROM = "vllm:lw_pool_"


def run(job: dict[str, Any]) -> None:
    # In-process engine core: the measured wall time has no IPC hop in it and vLLM's thread
    # set-up stays ours.
    stats_path = in_process_engine("lw-serve-stats-")
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {
        "model": job["model"],
        "dtype": job["dtype"],
        "enforce_eager": True,
        "block_size": job["block_size"],
        "max_model_len": job["max_model_len"],
        # One prompt is one prefill step: TTFT then holds exactly one load (or one recompute).
        "max_num_batched_tokens": job["max_model_len"],
        "kv_cache_memory_bytes": job["kv_cache_memory_bytes"],
        "enable_prefix_caching": job["prefix_caching"],
        "seed": 0,
        **job.get("engine", {}),
    }
    if job.get("metrics"):
        kw["disable_log_stats"] = False  # the connector's counters reach llm.get_metrics()
    if job.get("extra") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "LayerwiseStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": job["extra"],
        }
    t0 = time.perf_counter()
    llm = LLM(**kw)
    emit(STARTED + repr(time.perf_counter() - t0))
    engine = read_engine(stats_path)
    if engine is not None:
        emit(ENGINE + json.dumps(engine))
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if job.get("metrics"):
        _poll_step(llm, sp)  # the counters' baseline, before any measured request
    try:
        for item in job["items"]:
            open(stats_path, "w").close()
            t = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": item["tokens"]}], sp, use_tqdm=False)
            ttft = time.perf_counter() - t
            rec = {
                "id": item["id"],
                "ttft_s": ttft,
                "cached_tokens": out.num_cached_tokens,
                "pool": stats_for(settle(llm, stats_path, [out.request_id]), out.request_id),
            }
            emit(ITEM + json.dumps(rec))
        if job.get("metrics"):
            emit(METRICS + json.dumps(_pool_counters(llm, sp)))
    finally:
        os.unlink(stats_path)
    emit(DONE)


def _poll_step(llm: Any, sp: Any) -> None:
    """One short step (4 tokens: no full chunk, no pool traffic) a second after the last one: the
    connector polls the pool's own counters at most once a second, in a step, and its first poll is
    the baseline. Run before the items it makes every item count; after them, every item seen."""
    time.sleep(1.2)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], sp, use_tqdm=False)


def _pool_counters(llm: Any, sp: Any) -> dict[str, float]:
    """The connector's counters (``disk_hits``, ``disk_read_bytes``, ...), summed over labels."""
    _poll_step(llm, sp)
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith(_PROM) and hasattr(m, "value"):  # counters (histograms have count, sum)
            key = m.name[len(_PROM):].removesuffix("_total")
            out[key] = out.get(key, 0.0) + float(m.value)
    return out


if __name__ == "__main__":
    main(run)
