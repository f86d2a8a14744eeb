"""Shared fixtures: tiny random checkpoints of each supported family, as transformers models
and as minivllm models loaded from them; whether this process runs Triton's kernels in the
interpreter or compiled for a GPU, and which checks run where. And two hooks for the classroom:
each chapter's checks run the engine as that chapter built it, and, in a student copy, a check
that stops on another chapter's stub names the exercise to do first."""
from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import pytest
import torch
from collection import ALL_ITEMS
from tiny_models import CHAT_TEMPLATE, CONFIGS, hf_greedy, tiny_hf_model

import minivllm
from minivllm.config import engine as engine_config
from minivllm.course.exercises import prerequisite_note

torch.set_num_threads(1)  # tiny models gain nothing from a second thread; a shared machine loses a lot


# Engine defaults that a later chapter turned on: chapter -> (name in minivllm.config.engine, the value
# before it). The same table makes a student copy's engine the one its solved chapters built.
LATER_DEFAULTS = engine_config.LATER_DEFAULTS


def chapters_of(node: pytest.Item | pytest.Collector) -> list[str]:
    """The chapter markers (ch01 ...) of a test, or of the module or class a fixture belongs to:
    the closest level's that has any (a test's, or its parameter's, own chapter marker replaces
    its module's: a check in a chapter-10 file that needs chapter 12's speculation is chapter 12's)."""
    for level in reversed(node.listchain()):
        chapters = sorted({m.name for m in level.own_markers if re.fullmatch(r"ch\d\d", m.name)})
        if chapters:
            return chapters
    return []


@contextmanager
def engine_as_of(node: pytest.Item | pytest.Collector) -> Iterator[None]:
    """The engine as the chapter of `node` built it: every default a later chapter turned on is
    set back to its value before that chapter (a check that asks for the later feature, say
    enable_prefix_caching=True, still gets it). Nodes without a chapter get today's engine."""
    chapters = chapters_of(node)
    with pytest.MonkeyPatch.context() as patch:
        for chapter, (name, before) in LATER_DEFAULTS.items():
            if chapters and max(chapters) < chapter:
                patch.setattr(engine_config, name, before)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    """A fixture is made as of the chapter of its own scope's node: a module-scoped server in a
    chapter-10 file is chapter 10's engine, whichever test of the file happens to ask for it
    first (pytest makes it before that test's function-scoped fixtures)."""
    with engine_as_of(request.node):
        return (yield)


def name_the_prerequisite(item: pytest.Item):
    """In a student copy, a check may stop on the stub of another chapter's exercise (chapter 4's
    stage calls chapter 2's append_kv): say which exercise to do first, on the error's first
    line, which is the line `--tb=line` shows."""
    try:
        return (yield)
    except NotImplementedError as error:
        note = prerequisite_note(str(error), chapters_of(item))
        if note and not str(error).startswith(note):  # a module fixture's error is raised again for each test
            error.args = (f"{note}. {error}",)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    # A junit report (--junitxml, for a gradebook) says which chapters each check belongs to.
    item.user_properties.append(("chapters", " ".join(chapters_of(item))))
    return (yield from name_the_prerequisite(item))  # fixtures may call a stub too


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with engine_as_of(item):
        return (yield from name_the_prerequisite(item))


def wants_interpreter(cuda_available: bool, environ: Mapping[str, str]) -> bool:
    """Whether this test process runs Triton kernels in Triton's CPU interpreter: where there is
    no GPU (the only place they can run then), or where TRITON_INTERPRET=1 was set by hand."""
    return environ.get("TRITON_INTERPRET") == "1" or not cuda_available


# Triton decides between compiled and interpreted code when a @triton.jit function is defined,
# its own library (tl.sum, tl.max, ...) included, so the choice is made once per process, here,
# before anything imports Triton; it cannot be switched for some tests and back. A process that
# interprets runs the interpreter checks of chapters 8 and 9 and skips the GPU checks; a process
# on a GPU compiles, runs the GPU checks, and skips the interpreter checks, which then run in a
# process of their own (tests/test_interpreter_scope.py starts one). Setting the variable at
# collection instead, as those modules once did, interpreted every later test's kernels too.
INTERPRETER = wants_interpreter(torch.cuda.is_available(), os.environ)
if INTERPRETER:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETER_CHECKS = ["tests/test_ch08_triton.py", "tests/test_ch09_fused.py"]


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected check is read
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every collected check is kept for the checks about the suite (tests/collection.py). In a
    process that interprets Triton kernels on a machine with a GPU (TRITON_INTERPRET=1 by hand),
    the GPU checks would run interpreted kernels: skip them, saying where they run."""
    if INTERPRETER and torch.cuda.is_available():
        skip = pytest.mark.skip(reason="TRITON_INTERPRET=1: this process runs Triton's interpreter; "
                                       "the GPU checks run in a process without it (pytest -m gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    config.stash[ALL_ITEMS] = list(items)


@pytest.fixture(scope="module")
def triton_interpreter() -> None:
    """For checks that run Triton kernels on CPU tensors: skipped in a process that compiles them
    for the GPU (see INTERPRETER)."""
    pytest.importorskip("triton")
    if not INTERPRETER:
        pytest.skip("this process compiles Triton kernels for the GPU; the interpreter checks run in their own "
                    f"process: TRITON_INTERPRET=1 pytest {' '.join(INTERPRETER_CHECKS)}")


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def hf_models() -> dict:
    return {name: tiny_hf_model(name) for name in CONFIGS}


@pytest.fixture(scope="session")
def hf_model(hf_models, family):
    return hf_models[family]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, hf_models):
    """The tiny Qwen3 model saved as a checkpoint folder, for scripts that take --model."""
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    hf_models["qwen3"].save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model(hf_model):
    """minivllm's Decoder with the same weights as `hf_model` (fp32, CPU)."""
    return minivllm.load_model(hf_model, device="cpu")


@pytest.fixture(scope="session")
def default_model():
    """The embedded model (fp32, CPU): for checks that need a real tokenizer's text."""
    return minivllm.load_model(device="cpu")


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The embedded model's tokenizer with a chat template (it has none of its own): for the
    server's chat endpoints. Shared: a check must not change it."""
    tokenizer = minivllm.load_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def qwen3_model(hf_models):
    """minivllm's Decoder of the tiny Qwen3 model alone: for checks about the engine, which do
    not depend on the model family."""
    return minivllm.load_model(hf_models["qwen3"], device="cpu")


@pytest.fixture(scope="session")
def reference():
    """Greedy continuations from transformers, cached: reference(hf_model, prompt, n)."""
    cache: dict = {}

    def get(hf_model, prompt: list[int], n: int) -> list[int]:
        key = (id(hf_model), tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf_model, prompt, n)
        return cache[key]

    return get
