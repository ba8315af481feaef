"""``lw-pool``: operations on a pool outside vLLM.

    lw-pool purge --config '{"embedded_path": ..., "embedded_disk_path": ...}' --model 3f2a9c41d0be
    lw-pool purge --config @extra.json --all

``--config`` is the engines' ``kv_connector_extra_config`` (JSON, or ``@file``), parsed as strictly
as vLLM's start-up does; ``--model`` is the model fingerprint an engine logs at start-up (``lw-vllm:
pool keys lw1/<model>/<layout>/... model fingerprint <model>``): every object of that model goes, at
any layout and TP size. ``--all`` removes every object. It works with engines running (a reset
while they serve) or without (the embedded pool's disk tier survives restarts). Prints one JSON line
of counts; exit status 0 when done, 1 when objects still being read stayed (run it again), 2 on a
bad argument or a backend that cannot purge.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from lw_core.backend import BackendError
from lw_core.backends.registry import get_backend
from lw_core.config import ConfigError, parse_config
from lw_core.keys import KEY_VERSION

MODEL_FP = re.compile(r"^[0-9a-f]{12}$")  # lw_core.keys.fingerprint


def model_prefix(fp: str) -> str:
    """The key prefix of every object of the model whose fingerprint is ``fp``."""
    if not MODEL_FP.match(fp):
        raise ValueError(f"--model {fp!r} is not a model fingerprint: 12 lower-case hex digits, as an engine logs "
                         "at start-up ('model fingerprint <fp>')")
    return f"{KEY_VERSION}/{fp}/"


def _config(raw: str) -> dict[str, Any]:
    text = raw
    if raw.startswith("@"):
        with open(raw[1:], encoding="utf-8") as f:
            text = f.read()
    extra = json.loads(text)
    if not isinstance(extra, dict):
        raise ValueError("--config must be a JSON object (kv_connector_extra_config)")
    return extra


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lw-pool", description="Operations on a layerwise KV pool outside vLLM.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("purge", help="remove a model's objects (or all) from the pool, DRAM and disk tier")
    p.add_argument("--config", required=True, help="the engines' kv_connector_extra_config: JSON, or @FILE")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="model fingerprint (12 hex digits, from an engine's start-up log)")
    which.add_argument("--all", action="store_true", help="every object in the pool")
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="how long to retry objects being read (default 10)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if not 0 < args.timeout_s <= 3600:
            raise ValueError(f"--timeout-s {args.timeout_s:g} is not accepted; accepted: > 0 and <= 3600")
        prefix = "" if args.all else model_prefix(args.model)
        cfg = parse_config(_config(args.config))
        plugin = get_backend(cfg.backend)
        if plugin.purge is None:
            raise ValueError(f"backend {cfg.backend!r} cannot purge objects (it has no purge); restart or clear its "
                             "store with that store's own tools")
    except (ValueError, OSError, ConfigError, BackendError) as e:  # json's errors are ValueErrors
        print(f"lw-pool: {e}", file=sys.stderr)
        return 2
    try:
        counts = plugin.purge(cfg, prefix, args.timeout_s)
    except BackendError as e:
        print(f"lw-pool: purge failed: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"prefix": prefix, **counts}))
    if counts.get("leased"):
        print(f"lw-pool: {counts['leased']} object(s) were being read and stayed; run it again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
