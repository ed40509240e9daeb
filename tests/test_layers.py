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

# The engine's rooms, bottom to top: each may import the rooms listed (and nothing of the engine
# above it). docs/architecture.md says what each room holds.
ENGINE_ROOMS: dict[str, set[str]] = {
    "engine": set(),  # the seam: Engine protocol, GenerationRequest, GenerationResult, errors
    "engine.cpu": {"engine"},
    "engine.cache": {"engine", "engine.cpu"},
    "engine.model": {"engine", "engine.cpu", "engine.cache"},
    "engine.decode": {"engine", "engine.cpu", "engine.cache", "engine.model"},
    "engine.parallel.ring": {"engine", "engine.cpu", "engine.cache", "engine.model"},
    "engine.batching": {"engine", "engine.cpu", "engine.cache", "engine.model",
                        "engine.parallel.ring"},
    "engine.drafting": {"engine", "engine.cpu", "engine.cache", "engine.model", "engine.decode",
                        "engine.batching"},
    "engine.parallel.tensor": {"engine", "engine.cpu", "engine.cache", "engine.model",
                               "engine.drafting"},
}
ENGINE_ROOMS["engine.runner"] = set(ENGINE_ROOMS)  # builds an engine from all the rooms
ENGINE_BELOW = {"skulkp2p", "wire", "models", "progress", "atomic_file"}  # what any room may import outside engine

# Rooms whose modules may import mlx at the top; every other module of the package imports with
# mlx blocked (mlx loads only when a model does, on its worker thread).
# Training a drafting head runs models too; the CLI imports only its options, which import no
# mlx (checked through skulkp2p.cli below).
MLX_ROOMS = set(ENGINE_ROOMS) - {"engine"} | {"training"}  # training fits heads on a model

SEAM = {"engine"}  # what the layers that only run engines may see of the engine
# The layers above the engine: area -> areas it may import ("skulkp2p" is the package itself).
AREAS: dict[str, set[str]] = {
    "wire": set(), "progress": set(), "metrics": set(), "ports": set(), "ratelog": set(),
    "atomic_file": set(),
    "netfault": {"ports"},
    "models": {"wire", "progress"},
    "state_metrics": SEAM | {"engine.cpu", "metrics"},
    "telemetry": SEAM | {"engine.cpu", "metrics", "state_metrics"},
    "formats": SEAM | {"engine.decode"},
    "runtime": SEAM | {"telemetry"},
    "served": SEAM | {"engine.decode", "formats", "models", "progress", "ports"},
    "cluster": {"wire", "models", "engine.parallel.ring", "ratelog", "atomic_file"},  # ring: sans-I/O protocol
    "api": SEAM | {"formats", "runtime", "metrics", "telemetry", "state_metrics", "engine.cpu",
                   "ratelog"},
    "pipe": SEAM | {"formats", "runtime", "models"},
}
_ALL = set(AREAS) | set(ENGINE_ROOMS) | {"skulkp2p", "served", "api", "cluster"}
AREAS["training"] = set(ENGINE_ROOMS) | {"models", "progress"}
AREAS["node"] = _ALL - {"bench", "training"}  # the composition root
AREAS["bench"] = _ALL | {"node"}
AREAS["cli"] = _ALL | {"node", "bench", "training"}
AREAS["cli_reference"] = {"cli"}
AREAS["__main__"] = {"cli"}
for _area in AREAS.values():
    _area.add("skulkp2p")
for _room, _allowed in ENGINE_ROOMS.items():
    _allowed |= ENGINE_BELOW


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
    """The room of an engine module (`engine.decode`, `engine.parallel.ring`), else the first
    name under skulkp2p (`api`, `wire`)."""
    parts = module.split(".")[1:]
    if not parts:
        return "skulkp2p"
    if parts[0] != "engine":
        return parts[0]
    for depth in (3, 2):
        room = ".".join(parts[:depth])
        if room in ENGINE_ROOMS:
            return room
    return "engine"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _allowed(area: str) -> set[str]:
    return ENGINE_ROOMS.get(area) or AREAS.get(area, set())


def test_every_area_has_a_rule():
    areas = {_area(m) for m in _modules()}
    assert not areas - set(ENGINE_ROOMS) - set(AREAS) - {"skulkp2p"}


def test_layer_rules_hold():
    bad = [f"{m} -> {t}" for m, targets in _graph().items() for t in targets
           if _area(t) != _area(m) and _area(t) not in _allowed(_area(m))]
    assert not bad, "imports across layers or rooms:\n" + "\n".join(sorted(bad))


def test_the_rooms_form_no_cycle():
    """The room rules themselves are a hierarchy: no room may import one that may import it."""
    for room, allowed in ENGINE_ROOMS.items():
        for other in allowed - {room}:
            assert room not in ENGINE_ROOMS.get(other, set()), (room, other)


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
    assert "api" not in _allowed(_area("skulkp2p.engine.x"))
    assert _area("skulkp2p.engine.parallel.ring.frames") == "engine.parallel.ring"
    assert _area("skulkp2p.engine.decode.loop") == "engine.decode"
    assert _area("skulkp2p.engine.protocol") == "engine"
    assert _area("skulkp2p.engine") == "engine"
    assert "engine.decode" not in _allowed("engine.model")


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
    names = sorted(m for m in _modules()
                   if not m.endswith("__main__") and _area(m) not in MLX_ROOMS)
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


def test_no_folder_holds_more_than_fifteen_modules():
    crowded = {str(d.relative_to(ROOT)): n for d in [PKG, *PKG.rglob("*")] if d.is_dir()
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 15}
    assert not crowded, crowded


def test_one_meaning_per_file_name():
    """No two modules of the package share a file name (`__init__`, `__main__` aside)."""
    seen: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(PKG)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}
