"""``lw-bench serve --backend embedded,memcache,mooncake``: the main job on each pool backend, in one run.

The first backend named gets the full set of engines (``save``, ``bulk``, ``layerwise_d<d>``...,
plain names); every other backend ``b`` gets two: ``b/save`` (miss + save) and
``b/layerwise_d<h>`` (pool hit at the headline depth ``h``), all against the one ``recompute``
engine of the run. memcache and Mooncake pools are started here, through their plugins'
throwaway bench pools, and stopped when the run ends, failed or not:

* memcache: a MetaService on 127.0.0.1 and a holder process lending the pool's memory, so what a
  save engine put survives it for the fresh engines that load it (lw_memcache.local, holder=True).
* mooncake: a master on free ports of 127.0.0.1 and a holder process (lw_mooncake.local).

Per backend the report has two rows by prefix length: save overhead (``save`` TTFT / recompute
TTFT: a miss that also saves, against no pool) and hit / recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from lw_bench import bench_store

BACKENDS = ("embedded", "memcache", "mooncake")
# Each plugin's bench pool, set up for engines that come and go (saved objects outlive the saver).
_POOL_KW: dict[str, dict[str, Any]] = {"memcache": {"holder": True}, "mooncake": {"port": 0}}


def parse(text: str) -> list[str]:
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if not names or bad or len(set(names)) != len(names):
        raise SystemExit(f"lw-bench serve: --backend={text!r} must list distinct backends of {', '.join(BACKENDS)}")
    return names


def save_mode(cfg: dict[str, Any], backend: str) -> str:
    return "save" if backend == cfg["backends"][0] else f"{backend}/save"


def hit_mode(cfg: dict[str, Any], backend: str) -> str:
    name = f"layerwise_d{cfg['headline_depth']}"
    return name if backend == cfg["backends"][0] else f"{backend}/{name}"


def modes(cfg: dict[str, Any], extras: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any] | None, bool]]:
    """The engines of every backend after the first: ``(name, extra config, vLLM prefix cache on)``."""
    out: list[tuple[str, dict[str, Any] | None, bool]] = []
    for b in cfg["backends"][1:]:
        out.append((save_mode(cfg, b), {**extras[b], "use_layerwise": True}, False))
        out.append((hit_mode(cfg, b), {**extras[b], "use_layerwise": True,
                                       "layerwise_prefetch_layers": cfg["headline_depth"]}, True))
    return out


@contextmanager
def stores(cfg: dict[str, Any]) -> Iterator[dict[str, dict[str, Any]]]:
    """``{backend: kv_connector_extra_config keys selecting its pool}``; memcache's and Mooncake's
    services run until the block ends (also on an exception)."""
    with ExitStack() as stack:
        out: dict[str, dict[str, Any]] = {}
        for b in cfg["backends"]:
            if b == "embedded":
                out[b] = {"embedded_path": cfg["pool_path"], "embedded_capacity_bytes": cfg["pool_capacity_bytes"]}
                continue
            plugin = bench_store.plugin_of("serve", b)
            assert plugin.bench_pool is not None, b
            try:
                out[b] = dict(stack.enter_context(plugin.bench_pool(cfg["pool_capacity_bytes"], None, **_POOL_KW[b])))
            except ImportError as e:  # the plugin's store is not installed
                raise SystemExit(f"lw-bench serve --backend {b}: {e}") from None
        yield out


def rows(cfg: dict[str, Any], ttft: dict[str, dict[str, float | None]]) -> dict[str, dict[str, Any]]:
    """Per backend: save and hit TTFT by length, and both over the recompute TTFT of that length."""
    rec = ttft["recompute"]

    def over(xs: dict[str, float | None]) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for L, x in xs.items():
            base = rec[L]
            out[L] = x / base if x is not None and base else None
        return out

    table = {}
    for b in cfg["backends"]:
        save, hit = ttft[save_mode(cfg, b)], ttft[hit_mode(cfg, b)]
        table[b] = {"save_mode": save_mode(cfg, b), "hit_mode": hit_mode(cfg, b), "save_ttft_s": save,
                   "hit_ttft_s": hit, "save_vs_recompute": over(save), "hit_vs_recompute": over(hit)}
    return table


def print_rows(r: dict[str, Any]) -> None:
    lengths = [str(L) for L in r["config"]["lengths"]]
    print(f"per backend (layerwise, depth {r['config']['headline_depth']}): "
          "save = miss + save / no pool; hit = pool hit / recompute")
    print("  backend   " + "".join(f"{'save@' + L:>11}" for L in lengths) + "".join(f"{'hit@' + L:>11}" for L in lengths))
    for b, row in r["backend_rows"].items():
        cells = [row["save_vs_recompute"][L] for L in lengths] + [row["hit_vs_recompute"][L] for L in lengths]
        print(f"  {b:<9} " + "".join(f"{'-' if x is None else f'{x:.3f}':>11}" for x in cells))
