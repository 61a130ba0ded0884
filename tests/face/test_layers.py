"""Imports point one way: each layer imports only the layers above it (DESIGN.md, "Layers").

    core       mesh, layout, shards, ops, local, collectives, cost, errors, physgraph
    program    ir, fusion, evaluate, sharding, pins, grad, frontend
    plan       plan, explain, plan_split
    rewrites   rewrites/*
    optimizer  problem, egraph, extract, optimize
    lowering   lowering/*
    execution  simulate, runtime, launcher, calibrate
    face       __init__, __main__, cli, demo, models, sweep, plan_graph, fuzzing, parallelize

Within a layer, modules may import each other, but the module graph has no cycle. A project import
inside a function is a hidden edge: allowed only for an optional third-party dependency (matplotlib,
torch.distributed.tensor, scipy's solvers), never for a project module.

"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"egraph_did": ROOT / "egraph_did", "egraph_did.rewrites": ROOT / "rewrites",
            "egraph_did.lowering": ROOT / "lowering"}

LAYERS = {
    "core": ["mesh", "layout", "shards", "ops", "local", "collectives", "cost", "errors", "physgraph"],
    "program": ["ir", "fusion", "evaluate", "sharding", "pins", "grad", "frontend"],
    "plan": ["plan", "explain", "plan_split"],
    "rewrites": ["rewrites"],
    "optimizer": ["egglog_io", "protocol_cache", "expand", "problem", "egraph", "extract", "extract_dp", "chain", "optimize"],
    "lowering": ["lowering"],
    "execution": ["simulate", "runtime", "launcher", "calibrate"],
    "face": ["__init__", "__main__", "cli", "demo", "models", "sweep", "plan_graph", "fuzzing", "parallelize"],
}
ORDER = list(LAYERS)

def modules() -> dict[str, Path]:
    """Every project module by dotted name."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to.

    >>> layer_of("egraph_did.rewrites.views"), layer_of("egraph_did.ir"), layer_of("egraph_did")
    ('rewrites', 'program', 'face')
    """
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("rewrites", "lowering"):
        return parts[1]
    name = parts[1] if len(parts) > 1 else "__init__"
    for layer, names in LAYERS.items():
        if name in names:
            return layer
    raise AssertionError(f"module {module} has no layer: add it to LAYERS in tests/face/test_layers.py")


def _resolve(importer: str, is_pkg: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """Project modules an import statement names."""
    mods = modules()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = importer if is_pkg else importer.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return sorted({n for n in names if n in mods})


def edges() -> list[tuple[str, str, str]]:
    """(importer, imported, 'module' | 'function') for every project import."""
    out = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                where = "module" if id(node) in top or _in_top_level_block(tree, node) else "function"
                for target in _resolve(name, path.stem == "__init__", node):
                    if target != name:
                        out.append((name, target, where))
    return out


def _in_top_level_block(tree: ast.Module, node) -> bool:
    """An import under a module-level if/try (TYPE_CHECKING, optional features) counts as module level."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.If, ast.Try)) and any(n is node for n in ast.walk(stmt)):
            return not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                           and any(m is node for m in ast.walk(n)) for n in ast.walk(stmt))
    return False


def violations() -> set[tuple[str, str, str]]:
    bad = set()
    for a, b, where in edges():
        if where == "function":
            bad.add((a, b, "function-level import of a project module"))
        elif ORDER.index(layer_of(b)) > ORDER.index(layer_of(a)):
            bad.add((a, b, f"{layer_of(a)} imports {layer_of(b)}, a layer below it"))
    return bad


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_imports_point_up_the_layers_only():
    bad = violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(f"  {a} -> {b}: {why}"
                                                                      for a, b, why in sorted(bad))


def test_module_level_imports_have_no_cycle():
    g = nx.DiGraph((a, b) for a, b, where in edges() if where == "module")
    assert list(nx.simple_cycles(g)) == [], "import cycles"


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """A planted import of a lower layer is reported (the checks can fail)."""
    fake = tmp_path / "egraph_did"
    fake.mkdir()
    (fake / "mesh.py").write_text("from .runtime import run_plan\n\ndef f():\n    from . import plan\n")
    (fake / "runtime.py").write_text("")
    (fake / "plan.py").write_text("")
    monkeypatch.setitem(PACKAGES, "egraph_did", fake)
    monkeypatch.setitem(PACKAGES, "egraph_did.rewrites", tmp_path / "none")
    monkeypatch.setitem(PACKAGES, "egraph_did.lowering", tmp_path / "none")
    got = {(a, b) for a, b, _ in violations()}
    assert got == {("egraph_did.mesh", "egraph_did.runtime"), ("egraph_did.mesh", "egraph_did.plan")}


if __name__ == "__main__":  # pragma: no cover - print the current violations
    for v in sorted(violations()):
        print(v)
    pytest.main([__file__])
