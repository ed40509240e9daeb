"""The typed seams: no `Any` in a public signature of the layers the type checker covers
(`.ci/run` runs mypy over them; docs/development.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("engine", "api", "cluster", "node", "runtime", "formats")


def _public_any(source: str) -> list[str]:
    """`name:line` of each public function or method whose parameters or return name `Any`."""
    found: list[str] = []

    def visit(body: list[ast.stmt], public: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, public and not node.name.startswith("_"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                private = node.name.startswith("_") and not node.name.endswith("__")
                if not public or private:
                    continue
                args = node.args
                params = [*args.posonlyargs, *args.args, *args.kwonlyargs,
                          *([args.vararg] if args.vararg else []),
                          *([args.kwarg] if args.kwarg else [])]
                notes = [p.annotation for p in params] + [node.returns]
                if any(n is not None and any(isinstance(x, ast.Name) and x.id == "Any" or
                                             isinstance(x, ast.Attribute) and x.attr == "Any"
                                             for x in ast.walk(n)) for n in notes):
                    found.append(f"{node.name}:{node.lineno}")

    visit(ast.parse(source).body, True)
    return found


def test_no_any_in_a_public_signature():
    bad = [f"{path.relative_to(ROOT)}: {hit}"
           for area in CHECKED for path in sorted((ROOT / "skulkp2p" / area).rglob("*.py"))
           for hit in _public_any(path.read_text())]
    assert not bad, f"{len(bad)} public signatures name Any:\n" + "\n".join(bad)


def test_the_checker_finds_any_and_spares_private_names():
    source = ("from typing import Any\n"
              "def f(x: Any) -> int: ...\n"
              "def g(x: int) -> dict[str, Any]: ...\n"
              "def _h(x: Any) -> Any: ...\n"
              "class C:\n    def m(self, *a: Any) -> None: ...\n    def _n(self, x: Any): ...\n"
              "class _D:\n    def m(self, x: Any) -> None: ...\n"
              "def k(x: object) -> list[int]: ...\n")
    assert _public_any(source) == ["f:2", "g:3", "m:6"]
