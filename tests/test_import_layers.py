"""Layers import one way: no import cycle between spruce's top-level packages and modules, nor between any two of
its modules.

Every module under src/spruce is parsed (not imported); each `import spruce...` / `from spruce... import` (relative
ones resolved, function-level ones included) is an edge between the top-level parts it joins: `spruce.runtime.engine`
importing `spruce.models.llama` is the edge runtime -> models; `from spruce import LLM` is an edge to the root package
`spruce` (its __init__), `from spruce import cli` to `cli`. Imports under `if TYPE_CHECKING:` are annotations, not
imports, and are left out. The module graph has the same imports as edges between modules: `from spruce.models
import loader` is an edge to spruce.models.loader, `from spruce.models import ModelConfig` to the package
spruce.models (its __init__).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "spruce"
ROOT = "spruce"  # the root package's own __init__


def module_name(path: Path, src: Path = SRC) -> tuple[str, bool]:
    """(dotted name, is a package __init__): src/spruce/runtime/engine.py -> ("spruce.runtime.engine", False)."""
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def part_of(module: str) -> str:
    """The top-level part a dotted spruce module belongs to: "spruce.runtime.engine" -> "runtime"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node of `tree`, but those under `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def imported_modules(source: str, module: str, is_package: bool, src: Path = SRC) -> list[str]:
    """The spruce modules `module`'s source imports, relative imports resolved.

    `from spruce.P import X` names the module spruce.P.X when src has one (X.py or X/), else spruce.P:
    >>> imported_modules("from . import cli", "spruce.bench.cli", False)
    ['spruce.bench.cli']
    """
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
            continue
        if node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if node.level and not node.module:  # from . import x: the submodule x of the package
            found += [f"{target}.{a.name}" for a in node.names]
        else:
            found += [f"{target}.{a.name}" if is_module(f"{target}.{a.name}", src) else target for a in node.names]
    return [m for m in found if m == ROOT or m.startswith(ROOT + ".")]


def is_module(dotted: str, src: Path = SRC) -> bool:
    """Whether `dotted` (spruce.a.b) is a module or package under `src`."""
    path = src.parent.joinpath(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").exists()


def module_graph(src: Path = SRC) -> dict[str, dict[str, str]]:
    """{module: {imported module: the file that imports it}} over every module under `src`."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(src.rglob("*.py")):
        module, is_package = module_name(path, src)
        for target in imported_modules(path.read_text(), module, is_package, src):
            if target != module:
                graph.setdefault(module, {}).setdefault(target, str(path.relative_to(src.parent)))
    return graph


def import_graph(src: Path = SRC) -> dict[str, dict[str, str]]:
    """{part: {imported part: one file that imports it}} over every module under `src`."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(src.rglob("*.py")):
        module, is_package = module_name(path, src)
        here = part_of(module)
        for target in imported_modules(path.read_text(), module, is_package, src):
            there = part_of(target)
            if there != here:
                graph.setdefault(here, {}).setdefault(there, str(path.relative_to(src.parent)))
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None (depth-first search, in name order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    """"a -> b (a/x.py) -> a (b/y.py)": each edge with a file that makes it."""
    return cycle[0] + "".join(f" -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def test_no_import_cycle_between_top_level_parts():
    graph = import_graph()
    assert {"runtime", "models", "server", "cli"} <= set(graph), "the walk found too few modules: paths wrong?"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between spruce's top-level parts: {describe(cycle, graph)}"


def test_no_import_cycle_between_modules():
    """Within a part too, modules import one way (e.g. models/eagle.py and models/loader.py both read checkpoints
    through models/checkpoint_files.py, neither through the other)."""
    graph = module_graph()
    assert {"spruce.models.loader", "spruce.models.eagle"} <= set(graph), "the walk found too few modules"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between spruce's modules: {describe(cycle, graph)}"


def test_the_module_walk_finds_a_cycle_inside_one_part(tmp_path):
    """`from spruce.m import x` (x a module) and an import inside a function make a cycle of two modules of one
    part, which the part graph cannot see."""
    src = tmp_path / "spruce"
    (src / "m").mkdir(parents=True)
    (src / "m" / "__init__.py").write_text("")
    (src / "m" / "x.py").write_text("def f():\n    from spruce.m import y\n")
    (src / "m" / "y.py").write_text("from spruce.m.x import f\nfrom spruce.m import NAME\n")
    graph = module_graph(src)
    assert find_cycle(graph) == ["spruce.m.x", "spruce.m.y", "spruce.m.x"]
    assert graph["spruce.m.y"] == {"spruce.m.x": "spruce/m/y.py", "spruce.m": "spruce/m/y.py"}
    assert find_cycle(import_graph(src)) is None


def test_the_walk_finds_a_cycle_through_relative_and_function_level_imports(tmp_path):
    """A two-part cycle made of a relative import and an import inside a function is found and named."""
    src = tmp_path / "spruce"
    for package in ("a", "b"):
        (src / package).mkdir(parents=True)
        (src / package / "__init__.py").write_text("")
    (src / "a" / "x.py").write_text("from ..b import y\n")
    (src / "b" / "y.py").write_text("def f():\n    import spruce.a.x\n")
    (src / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spruce.a import x\n")
    (src / "a" / "z.py").write_text("from spruce import c\n")
    graph = import_graph(src)
    assert find_cycle(graph) == ["a", "b", "a"]
    assert describe(["a", "b", "a"], graph) == "a -> b (spruce/a/x.py) -> a (spruce/b/y.py)"
    assert graph["a"] == {"b": "spruce/a/x.py", "c": "spruce/a/z.py"}
    assert "c" not in graph  # its only import is under TYPE_CHECKING
    del graph["b"]
    assert find_cycle(graph) is None
