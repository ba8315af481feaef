"""A missing dependency fails the run instead of skipping its tests (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lw_dev import requirements as conftest

ROOT = Path(__file__).resolve().parents[1]


def test_every_required_module_is_installed_here() -> None:
    assert conftest.missing_dependencies(allowed="") == []


def test_a_missing_module_is_reported_unless_allowed(monkeypatch) -> None:
    monkeypatch.setitem(conftest.REQUIRED, "lw_no_such_module", "pip install lw-no-such-module")
    assert conftest.missing_dependencies(allowed="") == ["lw_no_such_module"]
    assert conftest.missing_dependencies(allowed="vllm, lw_no_such_module") == []


def test_pytest_refuses_to_start_without_a_required_module(tmp_path: Path) -> None:
    # A fake 'vllm' that cannot be found: a sitecustomize hides it from find_spec in the child.
    hide = tmp_path / "sitecustomize.py"
    hide.write_text(
        "import importlib.util as u\n"
        "_f = u.find_spec\n"
        "u.find_spec = lambda name, *a, **k: None if name == 'vllm' else _f(name, *a, **k)\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests/test_dependency_closure.py"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "vllm: vLLM's CPU build: bash scripts/install-vllm.sh" in p.stderr + p.stdout
    p = subprocess.run(cmd, cwd=ROOT, env={**env, "LW_TESTS_ALLOW_MISSING": "vllm"}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
