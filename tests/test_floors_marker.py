"""`.ci/floors` runs only the checks marked `floors` on the oldest transformers, Triton and xgrammar
that pyproject.toml declares: a check that touches one of them (tests/floors.py's rule) and lacks
the marker would leave a declared floor untested, so it fails here."""
from __future__ import annotations

import ast

import floors
from collection import ALL_ITEMS


def test_every_check_that_touches_a_floored_package_is_marked(request):
    # every check this session collected, whatever -m chose: the whole suite under the README's
    # commands, the files named when pytest is given some
    unmarked = floors.missing_marker(request.config.stash[ALL_ITEMS])
    assert not unmarked, ("checks that run transformers, Triton or xgrammar code but are not marked `floors` "
                          "(add pytest.mark.floors to the test, or to the module's pytestmark):\n" + "\n".join(unmarked))


def test_the_rule_sees_each_way_a_check_reaches_a_floored_package(monkeypatch):
    """The rule itself, on a module written here: each kind of reach is found, and a check that
    reaches nothing is left alone."""
    source = '''
import subprocess
import transformers
from minivllm import LLM
from minivllm.attention.masks import causal_mask
from tiny_models import hf_greedy, random_prompts

CONFIG = transformers.LlamaConfig
def helper():
    return CONFIG()
def test_import(): transformers.AutoConfig
def test_minivllm(): LLM()
def test_helper(): helper()
def test_tiny_models(): hf_greedy
def test_process(): subprocess.run
def test_fixture(hf_model): pass
def test_plain(): causal_mask(3); random_prompts([3])
'''
    tree = ast.parse(source)
    monkeypatch.setattr(floors, "module_tree", lambda name: tree if name == "test_made_up" else ast.parse(
        (floors.TESTS / f"{name}.py").read_text()))
    floors.module_taint.cache_clear()

    class Item:  # what why_floored reads of a pytest item
        path, cls = floors.TESTS / "test_made_up.py", None

        def __init__(self, name, fixturenames=()):
            self.name = self.originalname = name
            self.fixturenames = list(fixturenames)

    try:
        found = {n.name: floors.why_floored(Item(n.name, [a.arg for a in n.args.args])) for n in tree.body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    finally:
        floors.module_taint.cache_clear()
    assert found.pop("test_plain") is None
    assert all(found.values()), found
