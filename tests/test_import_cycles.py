"""No import circle between the modules of the workspace's packages: every module can be read and
tested from the bottom up. import-linter's contracts (root pyproject.toml, ``lint-imports``) order
the layers and lw-vllm's rooms; this checks every module pair, inside a layer or room too, with
the same import graph (grimp, which import-linter uses; imports inside functions and under
``TYPE_CHECKING`` count)."""

from __future__ import annotations

import grimp

PACKAGES = ("lw_core", "lw_memcache", "lw_mooncake", "lw_vllm", "lw_proxy", "lw_bench", "lw_dev")

# Known circles, each to be removed when it is broken, never added to:
ALLOWED = {
    # The CPU and the device pipeline benches import each other (pipeline dispatches to the device
    # mode, pipeline_device reuses the CPU bench's helpers); their step loop is being merged into
    # one, which breaks this circle (issue 31).
    frozenset({"lw_bench.pipeline", "lw_bench.pipeline_device"}),
}


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each import circle as its shortest chain ``[a, b, ..., a]``, one per pair of modules that
    import each other directly or through others (the pair's set of modules is the key)."""
    found: dict[frozenset[str], list[str]] = {}
    for m in sorted(graph.modules):
        for d in sorted(graph.find_modules_directly_imported_by(m)):
            back = graph.find_shortest_chain(importer=d, imported=m)
            if back is not None:
                chain = [m, *back]
                found.setdefault(frozenset(chain), chain)
    return sorted(found.values())


def test_no_import_circle_between_modules():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    left = [" -> ".join(c) for c in circles(graph) if frozenset(c) not in ALLOWED]
    assert left == []


def test_the_check_sees_a_circle():
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p.d", imported="p.a")
    assert circles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
