"""``lw-bench``'s modes: its own (pipeline, backend, serve, pd, proxy) and other packages' by the
``lw_bench.modes`` entry-point group; the console script and ``python -m lw_bench`` are the same
command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MODES = "{pipeline,backend,serve,pd,proxy}"


def test_console_script_and_module_list_every_mode():
    script = Path(sys.executable).with_name("lw-bench")
    for argv in ([str(script), "--help"], [sys.executable, "-m", "lw_bench", "--help"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert f"usage: lw-bench [-h] {MODES}" in r.stdout, r.stdout


def test_unknown_mode_names_the_accepted_ones():
    r = subprocess.run([sys.executable, "-m", "lw_bench", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr and "pipeline" in r.stderr, r.stderr
