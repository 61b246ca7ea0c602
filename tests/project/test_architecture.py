"""The architecture's rules, checked on the source: layers and no circles (import-linter contracts in
pyproject.toml), no circle between modules even when an import hides inside a function, no use of
another module's private names, files and signatures small enough to read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "plait"
MAX_LINES = 650  # "files stay under ~600 lines"
MAX_PARAMS = 10  # "functions take few parameters"
MAX_CLASS_LINES = 250  # a class a reader can hold in mind
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public despite the underscore


def python_files(*folders: Path) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


@pytest.mark.subprocess
def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" not in out.stdout.split("Contracts:")[-1].replace("0 broken", "")


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's components of the module graph (function-level imports included)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_no_import_circle_between_modules():
    graph = grimp.build_graph("plait")
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert circles == []


def private_uses(path: Path) -> list[str]:
    """`from plait.x import _y`, and `name._y` where `name` is not self/cls (another object's private)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait"):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and node.attr not in NAMEDTUPLE_API:
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            found.append(f"{path.name}:{node.lineno} uses .{node.attr}")
    return found


@pytest.mark.parametrize("folder", ["src", "tests", "benchmarks", "docs"])
def test_no_private_names_across_modules(folder):
    base = SRC if folder == "src" else ROOT / folder
    uses = [u for p in python_files(base) for u in private_uses(p)]
    assert uses == []


def test_files_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n}" for p in python_files(SRC)
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert big == []


def test_classes_stay_small():
    big = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
           for p in python_files(SRC) for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert big == []


def test_functions_take_few_parameters():
    wide = []
    for p in python_files(SRC):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) > MAX_PARAMS:
                    wide.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}({len(names)})")
    assert wide == []


def test_every_runtime_keeps_its_whole_contract():
    """Every runtime is a trainer's stream; local and ray also drive a job. None has a method of a
    contract it does not keep (no raising plan/build on a thin client)."""
    import inspect

    from plait.runtime import DRIVERS, RUNTIMES, JobDriver, RankStream, runtime_class

    def methods(proto) -> list[str]:
        return [n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")]

    assert {"iter_rank", "state_dict", "state_after", "load_state_dict", "close"} <= set(methods(RankStream))
    assert set(methods(JobDriver)) == {"plan", "build", "release"}
    for name in ("local", "node", "ray", "flight"):
        assert name in RUNTIMES
        cls = runtime_class(name)
        contracts = [RankStream, JobDriver] if name in DRIVERS else [RankStream]
        for proto in contracts:
            for method in methods(proto):
                assert hasattr(cls, method), f"{name} runtime lacks {method}"
                want = list(inspect.signature(getattr(proto, method)).parameters)
                have = list(inspect.signature(getattr(cls, method)).parameters)
                assert have[: len(want)] == want or "args" in have[-1:], f"{name}.{method}{have} != contract {want}"
        if name not in DRIVERS:
            assert not any(hasattr(cls, m) for m in methods(JobDriver)), f"{name} offers half a driver"