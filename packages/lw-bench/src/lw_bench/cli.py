"""``lw-bench MODE``: each mode lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> dict``. ``--json`` prints the returned dict as one JSON object instead of a table."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# mode -> module; modules are imported only when chosen, so a mode's heavy deps stay optional.
MODES = {
    "pipeline": "lw_bench.pipeline",
    "backend": "lw_bench.backend",
    "serve": "lw_bench.serve.mode",  # needs lw-bench[vllm] and a vLLM build
    "pd": "lw_bench.pd.mode",
    "proxy": "lw_bench.proxy.mode",  # needs lw-bench[proxy] (lw-proxy)
}


def register_mode(name: str, module: str) -> None:
    """Add a mode in this process (other packages use the ``lw_bench.modes`` entry-point group)."""
    MODES[name] = module


def _extra_modes() -> None:
    # Modes of sibling packages, when installed; absent packages simply contribute nothing.
    from importlib.metadata import entry_points

    for ep in entry_points(group="lw_bench.modes"):
        MODES.setdefault(ep.name, ep.value)


def main(argv: list[str] | None = None) -> int:
    _extra_modes()
    parser = argparse.ArgumentParser(prog="lw-bench", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    modules = {}
    for name, modname in MODES.items():
        p = sub.add_parser(name)
        p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:  # a sibling package's deps are missing: say so only if chosen
            p.set_defaults(_import_error=f"lw-bench {name}: {e}")
            continue
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    if getattr(args, "_import_error", None):
        print(args._import_error, file=sys.stderr)
        return 2
    result = modules[args.mode].run(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
