"""The package's layering (docs/architecture.md), checked from the source: no module imports from
a layer above its own, and no two modules import each other, directly or around a circle.

Imports are read from each file's syntax tree, lazy ones inside functions included (a lazy import
is still a dependency); imports under `if TYPE_CHECKING:` are type hints and are left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "minivllm"
# Bottom to top, as docs/architecture.md draws it. A module may import its own folder and anything
# on a lower layer. Folders and root modules not listed here fail the test: place them first.
LAYERS = [
    {"config", "plots", "text", "triton_support"},
    {"attention"},
    {"model"},
    {"fused", "loader", "machine"},
    {"engine", "distributed"},  # chapter 14 drives the engine's model runner from beside it
    {"core_process"},  # chapter 15: the engine core in a process of its own, and its client
    {"stages", "serving", "llm"},  # the ways in: chapter scripts, the server, the offline LLM
    {"bench"},
    {"cli", "exercises"},
    {"__init__"},
]
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The folder or root module a module belongs to: minivllm.engine.llm -> engine."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, modules: set[str]) -> set[str]:
    """The minivllm modules `path` imports at run time (`from pkg import submodule` counts as
    importing the submodule)."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for block in ast.walk(tree)
                 if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
                 for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("minivllm")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minivllm"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports(f, modules) for f in files}


def test_every_folder_has_a_layer():
    unplaced = sorted({part_of(m) for m in import_graph()} - set(LAYER_OF))
    assert not unplaced, f"place {unplaced} in LAYERS (and in docs/architecture.md)"


def test_no_module_imports_from_a_layer_above():
    upward = [f"{module} imports {dep}" for module, deps in import_graph().items() for dep in sorted(deps)
              if part_of(dep) != part_of(module) and LAYER_OF.get(part_of(dep), -1) > LAYER_OF.get(part_of(module), -1)]
    assert not upward, "imports against the layering of docs/architecture.md:\n" + "\n".join(upward)


def test_no_import_circles():
    graph = import_graph()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep in graph and dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
