"""The package's layering (docs/architecture.md), checked from the source: no module imports from
a layer above its own, and no two modules import each other, directly or around a circle.

Every import counts: those inside functions (a lazy import is still a dependency) and those under
`if TYPE_CHECKING:` (a type hint names what a module must know about, so it is an arrow too).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "minivllm"
# Bottom to top, as docs/architecture.md draws it. A module may import its own folder and anything
# on a lower layer. Folders and root modules not listed here fail the test: place them first.
LAYERS = [
    {"triton_support"},  # where Triton kernels can run
    {"attention"},  # how queries meet the past: masks, dense, paged, Triton
    {"model"},  # the decoder (and ModelConfig, its shape)
    {"fused", "loader", "machine", "distributed", "structured_outputs"},  # around the model
    {"config", "request"},  # the engine's settings; a request's parameters, state, outputs, wire types
    {"kv_transfer"},  # chapter 17: the KV connector, called by the scheduler (core) and the model runner (worker)
    {"worker"},  # the model runner: a step's plan -> one forward pass -> tokens
    {"executor"},  # chapter 14: one step across N ranks
    {"core"},  # the engine core: scheduler, KV blocks, step phases, the core process
    {"engine"},  # the frontend: LLMEngine, AsyncLLM, input/output processing, the core client
    {"entrypoints"},  # the ways in: LLM, the CLI, the OpenAI server
    {"stages"},  # chapters 1-6's ladder (minivllm.stages.STAGES)
    {"course"},  # the course kit: benchmarks, plots, tour, exercises
    {"__init__"},
]
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}
MAX_ROOT_MODULES = 8  # loose modules at the package root, __init__ included


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The folder or root module a module belongs to: minivllm.engine.llm -> engine."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, modules: set[str]) -> set[str]:
    """The minivllm modules `path` imports, anywhere in the file (`from pkg import submodule`
    counts as importing the submodule)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
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


def test_the_package_root_stays_small():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_ROOT_MODULES, f"{len(loose)} modules at the package root: {loose}"


def test_the_engine_never_imports_the_course():
    course = [f"{module} imports {dep}" for module, deps in import_graph().items() for dep in sorted(deps)
              if part_of(dep) == "course" and part_of(module) not in ("course", "__init__")]
    assert not course, "the engine must not import the course kit:\n" + "\n".join(course)


def loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `statement`."""
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    return set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              timeout=120).stdout.split())


@pytest.mark.floors
def test_the_user_facing_imports_load_no_course_module_and_no_matplotlib():
    for statement in ("from minivllm import LLM", "from minivllm.entrypoints.openai.app import build_app"):
        loaded = loaded_by(statement)
        wrong = sorted(m for m in loaded if m.startswith(("minivllm.course", "matplotlib")))
        assert not wrong, f"{statement!r} loads {wrong[:8]}"


@pytest.mark.floors
def test_the_wire_types_load_no_engine():
    """A process that only decodes the frontend-core messages loads the request types, not the
    scheduler, the model runner or the model."""
    loaded = loaded_by("import minivllm.request.messages")
    engine = sorted(m for m in loaded if m.startswith("minivllm.") and part_of(m) not in ("request", "structured_outputs"))
    assert not engine, f"the wire types load {engine}"


def test_at_most_two_modules_build_an_output_processor():
    builders = sorted(str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
                      if "OutputProcessor(" in f.read_text() and f.name != "output_processor.py")
    assert len(builders) <= 2, f"the frontends are written more than twice: {builders}"
