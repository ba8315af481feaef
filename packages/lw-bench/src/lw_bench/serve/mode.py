"""``lw-bench serve``: time to first token (TTFT) of a real vLLM engine with the connector on the
embedded pool -- recompute vs pool hits in bulk and layerwise mode -- at several prompt lengths.

Set-up: a Llama-style model built locally with random weights (``lw_bench.models``:
12 layers, hidden 1024, GQA 16/4 heads of 64, float32 by default; ``--quick``: the 4-layer test
model; ``--model swa``: the same size with Gemma 3's pattern, five 512-token sliding-window layers to
one full-attention layer, also run as ``layerwise_hma_off`` with vLLM's hybrid KV cache manager off;
``--model gdn``: the same size with Qwen3-Next's pattern, three gated delta-net layers to one
full-attention layer, bf16, block 512, vLLM's prefix cache on in every engine, ``save`` too, so vLLM
hands off the recurrent state at the prompt's last block boundary, which is the prefix's end),
vLLM's CPU build, block size 32 (gdn 512). Each prompt is a *shared prefix* of ``L`` tokens (the
length in the table) followed by a short unique tail (``--tail`` tokens, less than a block, so the
tail is never a full chunk and nothing new is saved by the measured engines). Every prefix is
used by two requests: ``first`` (prefix + tail 0) and ``second`` (prefix + tail 1).

Engines, each a fresh process (``lw_bench.serve.engine``), one after another; ``save`` runs
once, every other mode once per ``--rounds`` (default 2, alternating the order of the modes so a
spell of load from other work on the machine does not land on one mode alone):

* ``save``      -- connector (layerwise), empty pool, vLLM prefix cache off: every ``first``
  request misses, is computed and saved. Its TTFT is a miss plus the save; it fills the pool.
* ``recompute`` -- no connector, vLLM prefix cache on: ``first`` is a full prefill; ``second``
  is a hit in vLLM's own prefix cache (``local``).
* ``bulk``, ``layerwise_d1``, ``layerwise_d2``, ... -- the connector in that mode (prefetch depth
  ``d``), vLLM prefix cache on. The engine has never seen the prefix, so ``first`` is a pool hit
  of ``L`` tokens (checked: promised == loaded == ``L``); ``second`` hits vLLM's prefix cache with
  the pool layered over it (the connector still looks every request up).

Before the measured requests each engine runs one warm-up prefix per length (same path, not
counted). Requests run one at a time with ``max_tokens=1``; the wall time of that ``generate``
call is the TTFT. Figures are medians over ``--reps`` prefixes per length x ``--rounds``, all from
one run.

The engine's compute runs on ``--threads`` OpenMP threads (default 1): on a small shared machine
two threads stall on each other's barriers whenever another process holds a core, and one core
stays free for the pool's copy thread -- the role a device's copy engine plays.

The report is a ``lw_bench.serve.result.ServeBenchResult`` (its fields are the JSON's keys; ``run``
returns it as the JSON object, lengths as string keys, times in seconds):

* ``config``: ``model``, ``layers``, ``hidden``, ``dtype``, ``block_size``, ``lengths``, ``reps``,
  ``rounds``, ``depths``, ``tail``, ``threads``, ``kv_bytes_per_token``, ``pool_path``,
  ``pool_capacity_bytes``, ``headline_depth``, ``max_model_len``, ``kv_cache_memory_bytes``,
  ``backends``; with ``--disk-dir``: ``disk_dir``, ``disk_dram_bytes``, ``disk_capacity_bytes``
* ``modes``: engine names in first-run order (``save``, ``recompute``, ``bulk``, ``layerwise_d<d>``...)
* ``ttft_s``: ``{mode: {L: median TTFT of first requests}}``
* ``local_ttft_s``: ``{mode: {L: median TTFT of second requests}}`` (not for ``save``)
* ``pool_hit_tokens``: ``{mode: {L: median tokens the connector loaded for first requests}}``
  (0 for ``recompute``; the saved tokens for ``save``)
* ``pool_loaded_bytes``: ``{mode: {L: median bytes the connector read from the pool per first
  request}}`` for pool modes (``--model swa``: the sliding-window layers read only their window)
* ``pool_load_s``: ``{mode: {L: median of (first - second) TTFT}}`` for pool modes: what loading
  the prefix from the pool costs beyond reading it from vLLM's own cache (same tokens computed)
* ``samples``: ``{mode: {L: {"first": [s...], "second": [s...]}}}`` every measured request
* ``ratios``: at the longest length ``Lmax``:
  ``hit_vs_recompute`` ``{mode: ttft[mode] / ttft[recompute]}`` per pool mode;
  ``layerwise_vs_bulk`` ``{d: ttft[layerwise_d] / ttft[bulk]}``;
  ``layered_vs_local`` ``{mode: local_ttft[mode] / local_ttft[recompute]}`` per pool mode (the
  pool layered over vLLM's prefix cache vs that cache alone);
  ``load_layerwise_vs_bulk`` ``{d: pool_load[layerwise_d] / pool_load[bulk]}``: the same
  comparison as ``layerwise_vs_bulk`` on the load cost alone, each term taken within one engine,
  so engine-to-engine differences (the machine's load while that engine ran) cancel out;
  ``loaded_bytes_vs_hma_off`` (``--model swa``) ``{mode: pool_loaded_bytes[mode] /
  pool_loaded_bytes[layerwise_hma_off]}``: bytes read per hit with vLLM's hybrid KV cache manager
  on (windowed layers read their window) against off (every layer reads every chunk)
* ``headline``: ``hit_vs_recompute`` (layerwise at ``headline_depth``), ``layerwise_vs_bulk``
  (same depth), ``layered_vs_local`` (same depth), ``targets`` (0.3, 0.85, 1.0), ``length``
* ``states`` (``--model gdn``): ``chunk_objects``, ``objects`` (state objects the save engine
  committed besides its chunks, from its pool counters), ``per_prefix``, ``bytes_per_object``,
  ``save_failed_objects``, ``ssm_dtype`` (the recurrent state's dtype as the engine ran it: float32
  on CPUs with AVX512-BF16, bf16 elsewhere; it sets ``bytes_per_object``); a hit loads one state
  object, counted in ``pool_loaded_bytes``
* ``checks``: ``pool_hits_ok`` (every first request of a pool mode loaded exactly ``L`` tokens,
  none failed), ``local_hits_ok`` (every second request was a vLLM prefix-cache hit of ``L``),
  ``saved_ok`` (the save engine saved ``L / block_size`` chunks per prefix), ``problems``
* ``engine_start_s``: ``{mode: median s over its rounds}``; ``runtime_s``; ``loadavg``: the machine's 1-minute load
  average before and after (other work on the machine makes every figure noisier)
* ``plot``: the PNG path, when ``--plot`` was given (``--save`` writes this same object to a file)
* ``backend_rows``: ``{backend: {save_mode, hit_mode, save_ttft_s, hit_ttft_s, save_vs_recompute,
  hit_vs_recompute}}`` by length, for each backend of ``--backend`` (lw_bench.serve.backends: the
  first backend runs every mode above, each other one ``<backend>/save`` and
  ``<backend>/layerwise_d<headline_depth>``, on a memcache or Mooncake pool the bench starts)
* ``disk`` (``--disk-dir``): the embedded pool's disk-hit row (lw_bench.serve.disk: engines
  ``disk/save`` and ``disk/hit``): ``hit_ttft_s``, ``vs_dram_hit``, ``vs_recompute``,
  ``read_gbps``, ``seq_read_gbps``, ``read_vs_seq`` (goal ``target`` 0.8), ``disk_hits`` and
  ``disk_read_bytes`` per disk/hit engine (the connector's counters), ``disk_hits_ok``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from typing import Any

import msgspec

from lw_bench.serve import backends, disk
from lw_bench.serve.result import checked
from lw_bench.serve.run import EngineError, run_engine

BLOCK_SIZE = 32
# ``--model gdn``: vLLM raises a GDN hybrid's attention block until a page holds a layer's recurrent
# state (268 KiB with a float32 16 x 64 x 64 state and a bf16 convolution state, as vLLM's CPU
# platform stores it on CPUs with AVX512-BF16; 140 KiB with the bf16 state it keeps elsewhere);
# asked for 512 tokens (512 KiB pages) it keeps them either way (checked: _run_engines).
GDN_BLOCK_SIZE = 512
MODELS = ("bench", "tiny", "swa", "gdn")
# ``--model swa``: the same layerwise mode with vLLM's hybrid KV cache manager off, so the
# sliding-window layers keep and move every chunk like full ones (bytes moved per hit compared).
HMA_OFF = "layerwise_hma_off"
DTYPES = ("float32", "bfloat16")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_TARGETS = {"hit_vs_recompute": 0.3, "layerwise_vs_bulk": 0.85, "layered_vs_local": 1.0}
MAX_PROMPT = 16384  # the bench models are built with room for this many tokens when a length needs it


def role(mode: str) -> str:
    """What an engine does, whatever pool it runs on: ``memcache/save`` -> ``save``."""
    return mode.rsplit("/", 1)[-1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default=None, help="shared-prefix lengths in tokens, multiples of the block size: 32, gdn 512 (default 256,512,1024,2048; gdn 1024,2048,3584)")
    p.add_argument("--reps", type=int, default=3, help="prefixes per length; medians are reported (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="engines per measured mode, run in alternating order; samples are pooled (default 2)")
    p.add_argument("--depths", default="1,2,4", help="layerwise prefetch depths, comma-separated (default 1,2,4)")
    p.add_argument("--tail", type=int, default=16, help="unique tokens after the shared prefix, 1..31 (default 16)")
    p.add_argument("--model", choices=MODELS, default="bench", help="bench: 12 layers, hidden 1024; tiny: the 4-layer test model; swa: the bench size with Gemma 3's sliding-window pattern, also run with HMA off; gdn: the bench size with Qwen3-Next's gated delta-net pattern, bf16, block 512, prefix caching on in every engine (default bench)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="model and KV dtype (default float32; gdn: bfloat16, the only one it runs)")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads of the engine's compute (default 1; see the module doc)")
    p.add_argument("--backend", default="embedded", metavar="NAMES",
                   help="comma-separated pool backends, all in one run: embedded, memcache, mooncake (default embedded). "
                        "The first gets every mode; the others a save and a layerwise hit engine. memcache and Mooncake "
                        "are started by the bench on 127.0.0.1 and stopped after (see lw_bench.serve.backends)")
    p.add_argument("--disk-dir", default=None, metavar="DIR",
                   help="also measure the embedded pool's disk tier, in a fresh directory under DIR (a local disk, "
                        "not tmpfs): disk hits from a new, empty DRAM pool against DRAM hits, recompute and DIR's "
                        "sequential read (see lw_bench.serve.disk); needs embedded in --backend")
    p.add_argument("--disk-direct-io", action="store_true",
                   help="the disk engines read the tier with direct I/O (embedded_disk_direct_io: true)")
    p.add_argument("--pool-path", default=None, help="embedded pool directory (default: a fresh one on /dev/shm, removed after)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write TTFT vs prefix length per mode (needs matplotlib)")
    p.add_argument("--save", default=None, metavar="OUT.json", help="also write the JSON object to this file (the table is still printed)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, length 128, 1 rep, depth 2")
    p.add_argument("--engine-timeout-s", type=float, default=900.0, help="give up on one engine after this long (default 900)")


# --- configuration -------------------------------------------------------------------------------


def _int_list(name: str, text: str, *, lo: int) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"lw-bench serve: --{name}={text!r} must be comma-separated integers") from None
    if not vals or any(v < lo for v in vals):
        raise SystemExit(f"lw-bench serve: --{name}={text!r} must list integers >= {lo}")
    return sorted(set(vals))


def _model_spec(name: str) -> dict[str, Any]:
    from lw_bench import models

    return {"bench": models.BENCH_SPEC, "swa": models.BENCH_SWA_SPEC, "gdn": models.BENCH_GDN_SPEC}.get(name, models.GQA_SPEC)


def _attention_layers(spec: dict[str, Any]) -> int:
    """Layers that keep KV per token (a GDN hybrid's full-attention layers; every layer otherwise)."""
    n = int(spec["num_hidden_layers"])
    return n // int(spec.get("full_every", 2)) if spec["arch"] == "qwen3_next" else n


def _config(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.model, args.lengths, args.reps, args.depths, args.rounds = "tiny", "128", 1, "2", 1
    if args.lengths is None:
        args.lengths = "1024,2048,3584" if args.model == "gdn" else "256,512,1024,2048"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.model == "gdn" else "float32"
    if args.model == "gdn" and args.dtype != "bfloat16":
        raise SystemExit("lw-bench serve: --model gdn runs in bfloat16 only (vLLM's CPU GDN kernels)")
    bs = GDN_BLOCK_SIZE if args.model == "gdn" else BLOCK_SIZE
    lengths = _int_list("lengths", args.lengths, lo=bs)
    bad = [n for n in lengths if n % bs]
    if bad:
        raise SystemExit(f"lw-bench serve: --lengths {bad} are not multiples of the block size {bs}")
    depths = _int_list("depths", args.depths, lo=1)
    if not 1 <= args.tail < BLOCK_SIZE:
        raise SystemExit(f"lw-bench serve: --tail={args.tail} must be in 1..{BLOCK_SIZE - 1} (less than a block)")
    if args.reps < 1:
        raise SystemExit(f"lw-bench serve: --reps={args.reps} must be >= 1")
    if args.rounds < 1:
        raise SystemExit(f"lw-bench serve: --rounds={args.rounds} must be >= 1")
    if args.threads < 1:
        raise SystemExit(f"lw-bench serve: --threads={args.threads} must be >= 1")
    max_len = max(lengths) + args.tail
    if max_len > MAX_PROMPT:
        raise SystemExit(f"lw-bench serve: longest prompt {max_len} tokens (--lengths + --tail) exceeds the bench's {MAX_PROMPT}")
    names = backends.parse(getattr(args, "backend", "embedded"))
    if getattr(args, "disk_dir", None) and "embedded" not in names:
        raise SystemExit("lw-bench serve: --disk-dir measures the embedded pool's disk tier: add embedded to --backend")
    spec = _model_spec(args.model)
    layer_kv = 2 * spec["num_key_value_heads"] * spec["head_dim"] * _DTYPE_BYTES[args.dtype]
    kv_per_token = _attention_layers(spec) * layer_kv
    # Room by every layer's KV: a GDN hybrid's state pages take the attention page size.
    room_per_token = spec["num_hidden_layers"] * layer_kv
    saved_tokens = (args.reps + 1) * sum(lengths)
    cfg = {
        "model": args.model,
        "layers": spec["num_hidden_layers"],
        "hidden": spec["hidden_size"],
        "dtype": args.dtype,
        "block_size": bs,
        "lengths": lengths,
        "reps": args.reps,
        "rounds": args.rounds,
        "depths": depths,
        "tail": args.tail,
        "threads": args.threads,
        "kv_bytes_per_token": kv_per_token,
        "pool_capacity_bytes": max(64 << 20, 2 * saved_tokens * room_per_token),
        "headline_depth": 2 if 2 in depths else depths[0],
        "max_model_len": (max_len + bs) // bs * bs,
        # Room for a whole sweep (one prefix per length) twice over: a second request needs its
        # first request's blocks still in vLLM's prefix cache.
        "kv_cache_memory_bytes": max(64 << 20, 2 * (sum(lengths) + len(lengths) * 2 * bs) * room_per_token),
        "backends": names,
    }
    if getattr(args, "disk_dir", None):
        disk.configure(cfg, args.disk_dir, direct_io=bool(getattr(args, "disk_direct_io", False)))
    elif getattr(args, "disk_direct_io", False):
        raise SystemExit("lw-bench serve: --disk-direct-io needs --disk-dir")
    return cfg


# --- prompts -------------------------------------------------------------------------------------


def _prompts(cfg: dict[str, Any]) -> dict[tuple[str, int, int], tuple[list[int], list[int], list[int]]]:
    """``(kind, L, i) -> tokens``: kind ``warm``/``meas`` prefixes and their two tails."""
    rng = random.Random(20261130)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]  # ids 0..2 are the special tokens
    out = {}
    for L in cfg["lengths"]:
        for kind, n in (("warm", 1), ("meas", cfg["reps"])):
            for i in range(n):
                prefix = toks(L)
                out[(kind, L, i)] = (prefix, toks(cfg["tail"]), toks(cfg["tail"]))
    if cfg.get("disk_dir"):  # disk/save's flush prompts of the longest length: more than its DRAM pool holds
        for i in range(disk.flush_count(cfg)):
            out[("flush", max(cfg["lengths"]), i)] = (toks(max(cfg["lengths"])), toks(cfg["tail"]), [])
    return out


def _items(cfg: dict[str, Any], prompts: dict, *, second: bool, flush: bool = False) -> list[dict[str, Any]]:
    # Warm-ups first, then the measured prefixes rep-major, so drifts in the machine's load spread
    # over every length instead of landing on one. Within a sweep, every first request runs before
    # the second requests, so that (but for one) a second request follows another light one, not
    # a multi-second prefill whose after-effects would be billed to the prefix-cache hit.
    sweeps = [[("warm", L, 0) for L in cfg["lengths"]]]
    sweeps += [[("meas", L, i) for L in cfg["lengths"]] for i in range(cfg["reps"])]
    items = []
    for sweep in sweeps:
        for kind, L, i in sweep:
            prefix, t0, _ = prompts[(kind, L, i)]
            items.append({"id": f"{kind}/{L}/{i}/first", "tokens": prefix + t0})
        for kind, L, i in sweep if second else ():
            prefix, _, t1 = prompts[(kind, L, i)]
            items.append({"id": f"{kind}/{L}/{i}/second", "tokens": prefix + t1})
    for kind, L, i in sorted(k for k in prompts if k[0] == "flush") if flush else ():
        prefix, t0, _ = prompts[(kind, L, i)]
        items.append({"id": f"{kind}/{L}/{i}/first", "tokens": prefix + t0})
    return items


def _schedule(names: list[str], rounds: int) -> list[str]:
    """Engine run order: every save engine once, then every measured mode once per round, the order
    reversed on odd rounds, so a spell of load from other work on the machine is spread over
    the modes instead of landing on one of them."""
    order = [n for n in names if role(n) == "save"]
    measured = [n for n in names if role(n) != "save"]
    for r in range(rounds):
        order += measured if r % 2 == 0 else measured[::-1]
    return order


def _modes(cfg: dict[str, Any], extras: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any] | None, bool]]:
    """``(name, extra config or None, vLLM prefix cache on)`` in run order; ``extras``: each
    backend's pool keys (lw_bench.serve.backends.stores)."""
    base = extras[cfg["backends"][0]]
    # A GDN hybrid saves its states only with vLLM's prefix cache on ("align" state mode).
    modes = [
        ("save", {**base, "use_layerwise": True}, cfg["model"] == "gdn"),
        ("recompute", None, True),
        ("bulk", {**base, "use_layerwise": False}, True),
    ]
    modes += [(f"layerwise_d{d}", {**base, "use_layerwise": True, "layerwise_prefetch_layers": d}, True) for d in cfg["depths"]]
    if cfg["model"] == "swa":
        modes.append((HMA_OFF, {**base, "use_layerwise": True, "layerwise_prefetch_layers": cfg["headline_depth"]}, True))
    modes += backends.modes(cfg, extras)
    if cfg.get("disk_dir"):
        modes += disk.modes(cfg)
    return modes


# --- the run -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    if args.plot:
        _require_matplotlib()
    from lw_bench import models

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    # A model with room for the longest prompt (the usual 4096 unless a length needs more).
    room = 4096 if cfg["max_model_len"] <= 4096 else MAX_PROMPT + 2 * cfg["block_size"]
    model_dir = str(models.build_model(_model_spec(cfg["model"]), max_len=room))
    own_pool = args.pool_path is None
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else os.environ.get("TMPDIR", "/tmp")
    cfg["pool_path"] = args.pool_path or os.path.join(base, f"lw-bench-serve-{uuid.uuid4().hex[:8]}")
    try:
        with backends.stores(cfg) as extras:
            modes = _modes(cfg, extras)
            records, starts, counters, seq, engines = _run_engines(args, cfg, model_dir, modes)
    finally:
        if own_pool:
            shutil.rmtree(cfg["pool_path"], ignore_errors=True)
        disk.cleanup(cfg)
    result = summarize(cfg, [m[0] for m in modes], records)
    result["backend_rows"] = backends.rows(cfg, result["ttft_s"])
    if cfg["model"] == "gdn":
        result["states"] = _states(cfg, counters.get("save", []), engines.get("save"))
    if cfg.get("disk_dir"):
        result["disk"] = disk.rows(cfg, result, backends.hit_mode(cfg, "embedded"), seq, counters.get(disk.HIT, []))
        if not result["disk"]["disk_hits_ok"]:
            result["checks"]["problems"] = (result["checks"]["problems"] + [
                f"disk/hit engines counted disk_hits {result['disk']['disk_hits']}: a hit did not come from disk"])[:20]
    result["engine_start_s"] = {m: statistics.median(v) for m, v in starts.items()}
    result["runtime_s"] = time.perf_counter() - t_start
    result["loadavg"] = {"before": load_before, "after": os.getloadavg()[0]}
    if args.plot:
        _plot(result, args.plot)
        result["plot"] = args.plot
    result = msgspec.to_builtins(checked(result))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    if not getattr(args, "json", False):
        print_table(result)
    return result


def _run_engines(args: argparse.Namespace, cfg: dict[str, Any], model_dir: str,
                 modes: list[tuple[str, dict[str, Any] | None, bool]]) -> tuple[dict, dict, dict, list[float], dict]:
    """Every engine in schedule order: (records, start times, pool counters by mode, the disk
    tier directory's sequential reads, the connector's engine record by mode). An engine whose
    block vLLM raised past the one asked for (a hybrid's state page) ends the run: every figure
    counts chunks of ``block_size``."""
    from tqdm import tqdm

    prompts = _prompts(cfg)
    jobs = {}
    for name, extra, prefix_caching in modes:
        items = _items(cfg, prompts, second=role(name) != "save", flush=name == disk.SAVE)
        jobs[name] = {
            "model": model_dir, "dtype": cfg["dtype"], "block_size": cfg["block_size"],
            "max_model_len": cfg["max_model_len"], "kv_cache_memory_bytes": cfg["kv_cache_memory_bytes"],
            "prefix_caching": prefix_caching, "extra": extra, "items": items,
            "engine": {"disable_hybrid_kv_cache_manager": True} if name == HMA_OFF else {},
            **({"metrics": True} if name == disk.HIT or (name == "save" and cfg["model"] == "gdn") else {}),
        }
    schedule = _schedule([m[0] for m in modes], cfg["rounds"])
    env = {"OMP_NUM_THREADS": str(cfg["threads"])}
    records: dict[str, list[dict[str, Any]]] = {}
    starts: dict[str, list[float]] = {}
    counters: dict[str, list[dict[str, float]]] = {}
    seq: list[float] = []
    engines: dict[str, dict[str, Any]] = {}
    total = sum(len(jobs[name]["items"]) + 1 for name in schedule)
    with tqdm(total=total, desc="lw-bench serve", unit="step", file=sys.stderr) as bar:
        for name in schedule:
            job = jobs[name]
            bar.set_postfix_str(f"{name}: starting engine")
            if name == disk.HIT:  # a new, empty DRAM pool; the tier's files out of the page cache
                job = disk.fresh_dram(job, cfg)
                disk.drop_cache(cfg["disk_dir"])
                seq.append(disk.sequential_read_gbps(os.path.dirname(cfg["disk_dir"]), max(cfg["lengths"]) * cfg["kv_bytes_per_token"]))

            def on_event(kind: str, payload: Any, name: str = name) -> None:
                bar.update(1)
                bar.set_postfix_str(name)

            try:
                start_s, recs, pool, engine = run_engine(job, env=env, timeout_s=args.engine_timeout_s,
                                                         on_event=on_event)
            except EngineError as e:
                raise SystemExit(f"lw-bench serve: engine '{name}' failed: {e}") from None
            if engine is not None:
                if engine["block_size"] != cfg["block_size"]:
                    raise SystemExit(f"lw-bench serve: engine '{name}' runs blocks of {engine['block_size']} tokens, "
                                     f"not the {cfg['block_size']} asked for (vLLM raised them so a page holds the "
                                     "model's recurrent state)")
                engines.setdefault(name, engine)
            starts.setdefault(name, []).append(start_s)
            records.setdefault(name, []).extend(recs)
            if job.get("metrics"):
                counters.setdefault(name, []).append(pool)
    return records, starts, counters, seq, engines


# --- figures -------------------------------------------------------------------------------------


def _states(cfg: dict[str, Any], counters: list[dict[str, float]], engine: dict[str, Any] | None) -> dict[str, Any]:
    """``--model gdn``: the recurrent-state objects the save engine committed besides its chunks
    (its pool counters less the chunks its first requests saved). A hit loads one of them, which
    the connector's per-request ``loaded_bytes`` counts besides the chunks. ``ssm_dtype``: the
    dtype the save engine stored the recurrent state in (its engine record): vLLM's CPU platform
    picks float32 on CPUs with AVX512-BF16 and the model's bf16 elsewhere, which halves
    ``bytes_per_object``."""
    c = counters[0] if counters else {}
    chunks = (cfg["reps"] + 1) * sum(cfg["lengths"]) // cfg["block_size"]
    objects = int(c.get("saved_objects", 0)) - chunks
    state_bytes = int(c.get("saved_bytes", 0)) - chunks * cfg["block_size"] * cfg["kv_bytes_per_token"]
    return {
        "chunk_objects": chunks,
        "objects": objects,
        "per_prefix": objects / ((cfg["reps"] + 1) * len(cfg["lengths"])),
        "bytes_per_object": state_bytes // objects if objects > 0 else None,
        "save_failed_objects": int(c.get("save_failed_objects", 0)),
        "ssm_dtype": _ssm_dtype(engine),
    }


def _ssm_dtype(engine: dict[str, Any] | None) -> str | None:
    """The recurrent (last) state tensor's dtype of the engine record's state group."""
    for g in (engine or {}).get("groups", []):
        if g.get("dtypes"):
            return str(g["dtypes"][-1])
    return None



def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(cfg: dict[str, Any], modes: list[str], records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    bs = cfg["block_size"]
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    hits: dict[str, dict[str, list[int]]] = {}
    moved: dict[str, dict[str, list[int]]] = {}
    problems: list[str] = []
    ok = {"pool_hits_ok": True, "local_hits_ok": True, "saved_ok": True}
    for mode in modes:
        samples[mode] = {str(L): {"first": [], "second": []} for L in cfg["lengths"]}
        hits[mode] = {str(L): [] for L in cfg["lengths"]}
        moved[mode] = {str(L): [] for L in cfg["lengths"]}
        for rec in records.get(mode, []):
            kind, L, _, which = rec["id"].split("/")
            pool = rec["pool"] or {}
            if role(mode) == "save" and which == "first":
                if pool.get("saved_chunks") != int(L) // bs:
                    ok["saved_ok"] = False
                    problems.append(f"{mode} {rec['id']}: saved {pool.get('saved_chunks')} chunks, expected {int(L) // bs}")
            elif mode != "recompute" and which == "first":
                got = (pool.get("promised_tokens"), pool.get("loaded_tokens"), pool.get("failed_blocks"))
                if got != (int(L), int(L), 0):
                    ok["pool_hits_ok"] = False
                    problems.append(f"{mode} {rec['id']}: promised/loaded/failed {got}, expected ({L}, {L}, 0)")
            if which == "second" and rec["cached_tokens"] != int(L):
                ok["local_hits_ok"] = False
                problems.append(f"{mode} {rec['id']}: vLLM prefix cache hit {rec['cached_tokens']} tokens, expected {L}")
            if kind != "meas":
                continue
            samples[mode][L][which].append(rec["ttft_s"])
            if which == "first":
                n = pool.get("saved_chunks", 0) * bs if role(mode) == "save" else pool.get("loaded_tokens", 0)
                hits[mode][L].append(n or 0)
                if role(mode) not in ("save", "recompute"):
                    moved[mode][L].append(pool.get("loaded_bytes") or 0)

    lengths = [str(L) for L in cfg["lengths"]]
    pool_modes = [m for m in modes if role(m) not in ("save", "recompute")]
    ttft = {m: {L: _median(samples[m][L]["first"]) for L in lengths} for m in modes}
    local = {m: {L: _median(samples[m][L]["second"]) for L in lengths} for m in modes if role(m) != "save"}
    load = {
        m: {L: _median([a - b for a, b in zip(samples[m][L]["first"], samples[m][L]["second"])]) for L in lengths}
        for m in pool_modes
    }
    top = lengths[-1]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    ratios = {
        "hit_vs_recompute": {m: ratio(ttft[m][top], ttft["recompute"][top]) for m in pool_modes},
        "layerwise_vs_bulk": {str(d): ratio(ttft[f"layerwise_d{d}"][top], ttft["bulk"][top]) for d in cfg["depths"]},
        "layered_vs_local": {m: ratio(local[m][top], local["recompute"][top]) for m in pool_modes},
        "load_layerwise_vs_bulk": {str(d): ratio(load[f"layerwise_d{d}"][top], load["bulk"][top]) for d in cfg["depths"]},
    }
    loaded_bytes = {m: {L: statistics.median_low(moved[m][L]) if moved[m][L] else None for L in lengths}
                    for m in pool_modes}
    if HMA_OFF in pool_modes:
        ratios["loaded_bytes_vs_hma_off"] = {
            m: ratio(loaded_bytes[m][top], loaded_bytes[HMA_OFF][top]) for m in pool_modes if m != HMA_OFF}
    hd = cfg["headline_depth"]
    headline = {
        "length": int(top),
        "hit_vs_recompute": ratios["hit_vs_recompute"][f"layerwise_d{hd}"],
        "layerwise_vs_bulk": ratios["layerwise_vs_bulk"][str(hd)],
        "layered_vs_local": ratios["layered_vs_local"][f"layerwise_d{hd}"],
        "targets": dict(_TARGETS),
    }
    return {
        "config": cfg,
        "modes": modes,
        "ttft_s": ttft,
        "local_ttft_s": local,
        "pool_hit_tokens": {m: {L: statistics.median_low(hits[m][L]) if hits[m][L] else None for L in lengths} for m in modes},
        "pool_load_s": load,
        "pool_loaded_bytes": loaded_bytes,
        "samples": samples,
        "ratios": ratios,
        "headline": headline,
        "checks": {**ok, "problems": problems[:20]},
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 1 else f"{x * 1e3:.1f}"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / (1 << 20):.1f}"


def print_table(r: dict[str, Any]) -> None:
    c = r["config"]
    modes = r["modes"]
    lengths = [str(L) for L in c["lengths"]]
    w = max(12, max(len(m) for m in modes) + 1)
    print(
        f"lw-bench serve: {c['model']} model ({c['layers']} layers, hidden {c['hidden']}, {c['dtype']}), "
        f"block {c['block_size']}, {c['threads']} compute thread(s), prefix + {c['tail']}-token tail, "
        f"TTFT in ms, median of {c['reps']} prefixes x {c['rounds']} engine rounds"
    )
    print("first request of a prefix (save: miss + save; recompute: no pool; others: pool hit)")
    print("  prefix " + "".join(f"{m:>{w}}" for m in modes))
    for L in lengths:
        print(f"  {L:>6} " + "".join(f"{_ms(r['ttft_s'][m][L]):>{w}}" for m in modes))
    print("  pool hit tokens at the longest prefix: " + ", ".join(f"{m} {r['pool_hit_tokens'][m][lengths[-1]]}" for m in modes))
    lm = [m for m in modes if role(m) != "save"]
    print("second request (vLLM prefix cache hit; recompute = the cache alone, others = pool layered over it)")
    print("  prefix " + "".join(f"{m:>{w}}" for m in lm))
    for L in lengths:
        print(f"  {L:>6} " + "".join(f"{_ms(r['local_ttft_s'][m][L]):>{w}}" for m in lm))
    print("pool load cost = first - second request of a prefix, same engine (ms)")
    print("  prefix " + "".join(f"{m:>{w}}" for m in r["pool_load_s"]))
    for L in lengths:
        print(f"  {L:>6} " + "".join(f"{_ms(r['pool_load_s'][m][L]):>{w}}" for m in r["pool_load_s"]))
    print("bytes read from the pool per hit (MiB)")
    print("  prefix " + "".join(f"{m:>{w}}" for m in r["pool_loaded_bytes"]))
    for L in lengths:
        print(f"  {L:>6} " + "".join(f"{_mib(r['pool_loaded_bytes'][m][L]):>{w}}" for m in r["pool_loaded_bytes"]))
    h = r["headline"]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"
    print(
        f"at {h['length']} tokens, layerwise depth {c['headline_depth']}: "
        f"pool hit / recompute {fmt(h['hit_vs_recompute'])} (target <= {h['targets']['hit_vs_recompute']}), "
        f"layerwise / bulk {fmt(h['layerwise_vs_bulk'])} (target <= {h['targets']['layerwise_vs_bulk']}), "
        f"pool over prefix cache / prefix cache alone {fmt(h['layered_vs_local'])}"
    )
    for key, vals in r["ratios"].items():
        print(f"  {key}: " + ", ".join(f"{k} {fmt(v)}" for k, v in vals.items()))
    if r.get("states"):
        st = r["states"]
        print(f"recurrent states saved: {st['objects']} objects ({st['per_prefix']:.2f} per prefix) of "
              f"{st['bytes_per_object']} bytes (recurrent state in {st.get('ssm_dtype')}, vLLM's choice on this CPU), "
              f"beside {st['chunk_objects']} chunks; a hit loads one besides its chunks")
    backends.print_rows(r)
    if r.get("disk"):
        disk.print_rows(r["disk"], lengths)
    ck = r["checks"]
    print(
        f"checks: pool_hits_ok={ck['pool_hits_ok']} local_hits_ok={ck['local_hits_ok']} saved_ok={ck['saved_ok']}"
        + (f"; {'; '.join(ck['problems'][:3])}" if ck["problems"] else "")
    )
    if "runtime_s" in r:
        print(f"runtime {r['runtime_s']:.0f} s, load average {r['loadavg']['before']:.1f} -> {r['loadavg']['after']:.1f}")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("lw-bench serve --plot needs matplotlib: pip install 'lw-bench[plot]' (or pip install matplotlib)") from None


def _plot(r: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = r["config"]
    xs = c["lengths"]
    lengths = [str(L) for L in xs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    style: dict[str, tuple[str | None, str]] = {"save": ("#999", ":"), "recompute": ("#c44", "-"), "bulk": ("#e90", "-")}
    blues = ["#7ab8e8", "#2f7cc0", "#1b3f73", "#0b1d38"]
    for i, d in enumerate(c["depths"]):
        style[f"layerwise_d{d}"] = (blues[min(i, len(blues) - 1)], "-")
    # Other backends' and the disk tier's engines: one color each, dotted for their saves.
    for m, shade in zip([m for m in r["modes"] if "/" in m and role(m) != "save"], ["#2a9d3a", "#8e44ad", "#8b5a2b", "#444"]):
        style[m] = (shade, "-")
        style[m.rsplit("/", 1)[0] + "/save"] = (shade, ":")
    for m in r["modes"]:
        color, ls = style.get(m, (None, "-"))
        ys = [r["ttft_s"][m][L] for L in lengths]
        a1.plot(xs, [y * 1e3 if y is not None else float("nan") for y in ys], marker="o", ls=ls, color=color, label=m)
    a1.set_yscale("log")
    a1.set_title("first request of a prefix", fontsize=10)
    for m in r["modes"]:
        if role(m) in ("save", "recompute"):
            continue
        color, _ = style.get(m, (None, "-"))
        a2.plot(xs, [(r["ttft_s"][m][L] or float("nan")) * 1e3 for L in lengths], marker="o", color=color, label=f"{m} (pool hit)")
    a2.plot(xs, [(r["local_ttft_s"]["recompute"][L] or float("nan")) * 1e3 for L in lengths], marker="s", ls="--", color="#444",
            label="vLLM prefix cache hit (no pool)")
    hd = f"layerwise_d{c['headline_depth']}"
    a2.plot(xs, [(r["local_ttft_s"][hd][L] or float("nan")) * 1e3 for L in lengths], marker="s", ls=":", color="#444",
            label=f"prefix cache hit, pool layered ({hd})")
    a2.set_yscale("log")
    a2.set_title("hits only (pool vs vLLM's own prefix cache)", fontsize=10)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(xs, [str(x) for x in xs])
        a.set_xlabel("shared prefix (tokens)")
        a.set_ylabel("TTFT, ms (median)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"lw-bench serve: {c['layers']} layers, hidden {c['hidden']}, {c['dtype']}, vLLM CPU, median of {c['reps']}x{c['rounds']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
