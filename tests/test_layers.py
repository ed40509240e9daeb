"""The package's layer rules (docs/architecture.md), read from the source's imports, and the
promise that every layer but the MLX engine imports without mlx."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "skulkp2p"

# area -> areas it must never import (an area is the first name under skulkp2p).
FORBIDDEN = {
    "engine": {"bench", "api", "cluster", "served", "node", "cli", "pipe"},
    "cluster": {"api", "node", "bench", "cli", "served"},
    "api": {"node", "cluster", "bench", "cli", "served"},
    "served": {"api", "node", "cluster", "bench", "cli"},
    "models": {"api", "node", "cluster", "bench", "cli", "served", "engine"},
    "wire": {"api", "node", "cluster", "bench", "cli", "served", "engine"},
    "telemetry": {"api", "node", "cluster", "bench", "cli", "served"},
}

# Modules that are the MLX engine itself (they import mlx at the top, by design).
MLX_MODULES = {"caches", "decode", "draft_model", "forward", "generate", "loader", "mlx_engine",
               "model", "mtp_head", "mtp_drafter", "prefix_cache", "sampling", "stage", "trunk",
               "drafters", "gates", "blas", "width_costs", "batch_cache", "scheduler", "assistant",
               "tensor_shard", "ring_batch", "tree", "tree_accept", "arrays", "head_batch",
               "packed", "step_rope", "row_forward", "weight_first", "numpy_verify",
               "table_rope"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules `name` imports anywhere in its body (lazy imports count too)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".")
            if node.level:
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_layer_rules_hold():
    bad = [f"{m} -> {t}" for m, targets in _graph().items() for t in targets
           if _area(t) in FORBIDDEN.get(_area(m), set())]
    assert not bad, "imports across layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    # Tarjan's strongly connected components, iteratively (no recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The rules above can fail: a module of a fake package that breaks one is reported."""
    fake = {"skulkp2p.engine.x": tmp_path / "x.py", "skulkp2p.api.y": tmp_path / "y.py"}
    fake["skulkp2p.engine.x"].write_text("from skulkp2p.api import y\n")
    fake["skulkp2p.api.y"].write_text("")
    assert _imports("skulkp2p.engine.x", fake["skulkp2p.engine.x"], fake) == {"skulkp2p.api.y"}
    assert "api" in FORBIDDEN["engine"]


BLOCK_MLX = """
import importlib, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mlx", "mlx_lm"):
            raise ImportError("mlx is blocked in this test: " + name)
sys.meta_path.insert(0, Block())
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
    if any(m.split(".")[0] in ("mlx", "mlx_lm") for m in sys.modules):
        failed.append(f"{name} imported mlx")
        break
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.process
def test_layers_above_the_mlx_engine_import_without_mlx():
    names = sorted(m for m in _modules() if not m.endswith("__main__") and not (
        _area(m) == "engine" and m.split(".")[-1] in MLX_MODULES))
    assert "skulkp2p.api.app" in names and "skulkp2p.node.serving" in names
    assert "skulkp2p.cluster.node" in names and "skulkp2p.wire" in names
    out = subprocess.run([sys.executable, "-c", BLOCK_MLX, *names], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/; test modules import only that (and fixtures)."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "tests" and (len(parts) < 2 or parts[1] != "helpers"):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
                if parts[-1].startswith("test_") and parts[0] != "skulkp2p":
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
