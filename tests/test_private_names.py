"""No package imports another package's private names (``from lw_proxy.x import _helper``) or
modules: what a package offers its siblings has a public name. import-linter's contracts (root
pyproject.toml, ``lint-imports``) check modules; this checks the names imported from them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").glob("*/src/*") if (p / "__init__.py").exists())


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def cross_package_private_imports(src_root: Path) -> list[str]:
    """``file:line: name`` for each import under ``src_root`` of a private name or module that
    belongs to another of the workspace's packages."""
    hits = []
    for p in sorted(src_root.rglob("*.py")):
        own = p.relative_to(src_root).parts[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
                names = [*node.module.split("."), *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    if top in PACKAGES and top != own and any(map(_private, a.name.split("."))):
                        hits.append(f"{p.relative_to(src_root)}:{node.lineno}: {a.name}")
                continue
            else:
                continue
            if top in PACKAGES and top != own and any(map(_private, names)):
                hits.append(f"{p.relative_to(src_root)}:{node.lineno}: {node.module} import "
                            f"{', '.join(a.name for a in node.names)}")
    return hits


def test_packages_find_every_workspace_package():
    assert {"lw_core", "lw_memcache", "lw_mooncake", "lw_vllm", "lw_proxy", "lw_bench", "lw_dev"} <= set(PACKAGES)


def test_no_package_imports_another_packages_private_names():
    hits = [h for src in sorted((ROOT / "packages").glob("*/src")) for h in cross_package_private_imports(src)]
    assert hits == []


def test_the_check_sees_a_private_name_across_packages(tmp_path):
    (tmp_path / "lw_bench").mkdir()
    (tmp_path / "lw_bench" / "m.py").write_text(
        "from lw_proxy.bench import _wait_ready, serve_mocks\nimport lw_core._x\nfrom lw_bench.y import _ok\n")
    assert cross_package_private_imports(tmp_path) == [
        "lw_bench/m.py:1: lw_proxy.bench import _wait_ready, serve_mocks", "lw_bench/m.py:2: lw_core._x"]
