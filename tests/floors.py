"""Which checks the declared floors can change: the checks that run transformers, Triton or
xgrammar code. `.ci/floors` runs only the checks marked `floors` on the oldest versions that
pyproject.toml declares; this module says which checks must carry that marker, and
tests/test_floors_marker.py fails when one does not.

The rule, read from the source (so that it sees code paths a test run might miss). A check
touches a floored package when
1. one of its fixtures (pytest's closure of them: the fixtures its fixtures use too) is a
   fixture of conftest.py or of its own module that refers to a name of rule 2 or 3;
2. its function, its decorators (parametrize values) or its class refer to a name that reaches
   one: a name imported from transformers, triton or xgrammar (pytest.importorskip included);
   from a minivllm module that imports one, itself or through the minivllm modules it imports,
   at any depth, imports inside functions and modules named in strings (importlib) included
   (the packages above a module count by what they import on import: their functions are
   not called by importing it);
   from a test helper module (tiny_models ...) whose definition of that name refers to one; or
   a function, class or constant of the check's own module that refers to such a name;
3. or it starts another Python process (subprocess, multiprocessing, runpy, sys.executable),
   whose code cannot be read from here.
Over-approximate on purpose: a check marked that need not be costs seconds on the floors; a
check the floors break that is not marked lets a declared floor go untested.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

FLOORED_PACKAGES = frozenset({"transformers", "triton", "xgrammar"})
ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def imported_names(tree: ast.AST, package: str) -> dict[str, str]:
    """Local name -> the dotted name it was imported as ("AutoConfig" -> "transformers.AutoConfig"),
    imports inside functions included, those under `if TYPE_CHECKING:` left out (they never run)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds the module
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def split_module(dotted: str, modules: set[str]) -> tuple[str | None, list[str]]:
    """("a.b.c.name", {...}) -> the longest prefix that is a module ("a.b.c") and the packages above it
    ("a", "a.b"), whose __init__ runs when it is imported."""
    parts = dotted.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    module = next((m for m in prefixes if m in modules), None)
    return module, [m for m in prefixes if m in modules and m != module]


@functools.cache
def minivllm_reach() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(every minivllm module, those that can run a floored package's code once their functions
    are called (rule 2), those that run it on import). Importing a.b.c runs the __init__ of a and
    a.b too, but calls none of their functions: only their import-time reach counts for it."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "minivllm").rglob("*.py")}
    modules = set(files)
    anywhere: dict[str, set[str]] = {}
    on_import: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        anywhere[module] = set(imported_names(tree, package).values()) | {  # import_module("minivllm....")
            a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and "import" in ast.unparse(n.func)
            for a in n.args if isinstance(a, ast.Constant) and a.value in files}
        top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        on_import[module] = set(imported_names(ast.Module(top, []), package).values())

    def grow(edges: dict[str, set[str]], found: set[str], at_import: set[str]) -> set[str]:
        """Add every module with an edge into `found`, or into an import-time module above a target."""
        found = set(found) | {m for m, targets in edges.items() if {t.split(".")[0] for t in targets} & FLOORED_PACKAGES}
        while new := {m for m, targets in edges.items() if m not in found and any(
                (split := split_module(t, modules))[0] in found or set(split[1]) & (at_import | found)
                for t in targets)}:
            found |= new
        return found

    at_import = grow(on_import, set(), set())
    at_import |= {m for m in modules if set(split_module(m, modules)[1]) & at_import}
    return frozenset(modules), frozenset(grow(anywhere, at_import, at_import)), frozenset(at_import)


# Names that start another Python process: what runs there cannot be read from here, so a check
# that starts one is counted as touching the floors (rule 3).
OTHER_PROCESS = ("subprocess", "multiprocessing", "runpy", "sys.executable", "torch.multiprocessing")


def reaches_floors(dotted: str) -> bool:
    """Whether the imported name `dotted` ("minivllm.LLM", "tiny_models.hf_greedy") is rule 2's or 3's."""
    parts = dotted.split(".")
    if parts[0] in FLOORED_PACKAGES or any(dotted == p or dotted.startswith(p + ".") for p in OTHER_PROCESS):
        return True
    if parts[0] == "minivllm":
        import minivllm

        if len(parts) > 1 and parts[1] in minivllm._PUBLIC:  # the package's lazy names
            parts = minivllm._PUBLIC[parts[1]].split(".") + parts[2:]
        modules, reach, at_import = minivllm_reach()
        module, parents = split_module(".".join(parts), set(modules))
        return module in reach or bool(set(parents) & at_import)
    if (TESTS / f"{parts[0]}.py").is_file():  # a test helper module: the name itself must reach
        return len(parts) > 1 and parts[1] in module_taint(parts[0])
    return False


def references(node: ast.AST, names: dict[str, str]) -> set[str]:
    """What `node` refers to: imported names resolved to their dotted names (`load_model` ->
    "minivllm.load_model", `transformers.AutoConfig` -> "transformers.AutoConfig"), a module that
    pytest.importorskip imports, and the other names as they are."""
    found = set()
    for sub in ast.walk(node):
        chain = sub
        while isinstance(chain, ast.Attribute):
            chain = chain.value
        if isinstance(sub, (ast.Name, ast.Attribute)) and isinstance(chain, ast.Name):
            head, _, rest = ast.unparse(sub).partition(".")
            found.add(".".join(filter(None, [names.get(head, head), rest])))
        elif isinstance(sub, ast.Call) and ast.unparse(sub.func).endswith("importorskip") and sub.args \
                and isinstance(sub.args[0], ast.Constant):
            found.add(str(sub.args[0].value))
    return found


@functools.cache
def module_tree(name: str) -> ast.Module:
    return ast.parse((TESTS / f"{name}.py").read_text())


@functools.cache
def module_taint(name: str) -> frozenset[str]:
    """The top-level names of tests/`name`.py that reach a floored package: imported ones, then
    the functions, classes and constants that refer to them, until none is added."""
    tree = module_tree(name)
    names = imported_names(tree, "")
    tainted = {local for local, dotted in names.items() if reaches_floors(dotted)}
    definitions = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            definitions[node.name] = references(node, names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        definitions[leaf.id] = definitions.get(leaf.id, set()) | references(node.value, names)
    grew = True
    while grew:
        new = {d for d, refs in definitions.items()
               if d not in tainted and any(r in tainted or reaches_floors(r) for r in refs)}
        tainted |= new
        grew = bool(new)
    return frozenset(tainted)


def why_floored(item: pytest.Item) -> str | None:
    """What in `item` reaches a floored package, or None if nothing does."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & module_taint("conftest"):
        return f"fixture {min(fixtures & module_taint('conftest'))} (conftest.py)"
    module = Path(str(item.path)).stem
    try:
        tainted = module_taint(module)
    except OSError:  # not a module of tests/
        return None
    if fixtures & tainted:
        return f"fixture {min(fixtures & tainted)} of its module"
    names = imported_names(module_tree(module), "")
    wanted = item.cls.__name__ if item.cls else getattr(item, "originalname", item.name)  # a class: all of it
    for node in module_tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == wanted:
            for ref in sorted(references(node, names)):
                if ref in tainted or reaches_floors(ref):
                    return f"it refers to {ref}"
    return None


def missing_marker(items: list[pytest.Item]) -> list[str]:
    """'test id: why' for each check that touches a floored package without the `floors` marker."""
    return [f"{item.nodeid}: {why}" for item in items
            if item.get_closest_marker("floors") is None and (why := why_floored(item))]
