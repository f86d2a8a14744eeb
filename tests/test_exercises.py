"""The classroom exercises: the registry agrees with the source, stubs are right, and a student
copy of the repository really fails its chapters' checks (while this copy passes them)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from collection import ALL_ITEMS, files_with_chapters

from minivllm.course import exercises
from minivllm.course.exercises import (
    EXERCISES,
    NOTEBOOKS,
    STUBBED_CHAPTERS,
    Exercise,
    find_regions,
    make_student_copy,
    stub_source,
)

ROOT = exercises.PROJECT_ROOT
# In a student copy the solutions are gone: the checks that need them have nothing to check.
solutions = pytest.mark.skipif(not exercises.package_regions(), reason="a student copy: no solution regions")


@solutions
def test_every_region_is_registered_and_every_exercise_has_one_region():
    found = Counter((module, r.qualname) for module, regions in exercises.package_regions().items() for r in regions)
    registered = Counter((ex.module, ex.qualname) for ex in EXERCISES)
    unregistered = sorted(f"{m}.{q}" for m, q in found if (m, q) not in registered)
    assert not unregistered, f"solution regions missing from exercises.EXERCISES: {unregistered}"
    wrong = {f"{m}.{q}": found[m, q] for m, q in registered if found[m, q] != 1}
    assert not wrong, f"registered exercises must have exactly one region each; found (0 = none): {wrong}"
    duplicates = [key for key, n in registered.items() if n > 1]
    assert not duplicates, f"exercises registered twice: {duplicates}"


# What each exercise's docstring must say, as the student copy shows it: the contract its checks
# hold the student to (inputs, outputs, errors, invariants). The stub keeps only the signature
# and the docstring, so a rule that is not there lives only in the solution.
CONTRACTS = {
    "causal_mask": ["[n, n] torch.bool", "j <= i"],
    "append_kv": ["[T, Hkv, D]", "[max_len, Hkv, D]", "in place", "[start + T, Hkv, D]", "stay untouched"],
    "left_pad": ["[B, L] int64", "PAD_ID", "padding gets position 0"],
    "padded_causal_mask": ["[B, L, L] torch.bool", "never see padding", "sees only itself", "NaN"],
    "count_waste": ["(token_slots, wasted_slots)", "max(output_lens) - 1 decode steps", "padding"],
    "cu_seqlens": ["list of len(lengths) + 1 ints", "[0]", "ValueError"],
    "block_diagonal_mask": ["[T, T] torch.bool", "blind to every other"],
    "RaggedAttention.__call__": ["[T, Hq, D]", "[T, Hkv, D]", "segment.cache.k[layer]", "self.masks[i]",
                                 "cache.length"],
    "chunk_mask": ["[q_len, past + q_len] torch.bool", "past + i"],
    "plan_step": ["(index into prompt_left, count)", "Decodes come first", "chunk_size", "never a count of 0",
                  "ValueError"],
    "slot_mapping": ["list of end - start ints", "block_table[p // block_size]"],
    "gather_kv": ["[context_len, Hkv, D]", "[num_blocks, block_size, Hkv, D]", "padded with -1"],
    "BlockManager.grow": ["blocks_for(num_tokens)", 'RuntimeError("out of KV blocks', "change nothing"],
    "Scheduler.schedule": ["max_num_batched_tokens", "self.preempt", "out.preempted", "max_num_seqs",
                           "one block per running request", "admitted earlier in this same step", "no one overtakes",
                           "only if nothing was preempted", "its blocks for those tokens only", "out.add(seq, n)",
                           "return out"],
    "filter_logits": ["[S, V]", "-inf", "softmax over the kept", "always stays", "left unchanged",
                      "carries the running sum across top_p is kept", "equals the k-th largest stays"],
    "merge_partials": ["[..., P]", "[..., P, D]", "[..., D]", "-inf"],
    "bucket_for": ["ascending", ">= num_seqs", "ValueError"],
    "GraphRunner.prepare": ["self.static", "self.pad_block", "padding", "rewritten in place", "num_rows=size",
                            "out=", "torch.inference_mode", "first columns", "never copies the whole width"],
    "rope_cos_sin_table": ["[max_positions, D]", "[cos(p * inv_freq), sin(p * inv_freq)]", "bit for bit", "ValueError"],
    "new_deltas": ["c.finish_reason", "returns []", "that text goes out with c's next delta"],
    "find_stop_string": ["None if none", "len(s) - 1", "listed first wins"],
    "block_hashes": ["len(token_ids) // block_size", "hash_block(", "partly filled last block has no hash"],
    "PrefixCachingBlockManager.longest_cached_prefix": ["first hash not in self.cached", "Reads only", "never a gap"],
    "PrefixCachingBlockManager.release": ["young end of self.free", "last block first", "free + owned blocks = the pool",
                                          "`table` is empty"],
    "propose_ngram": ["most recent earlier occurrence", "token_ids[i+n : i+n+k]", "Returns []", "is not changed"],
    "rejection_sample": ["[S, K+1, V]", "uniforms[s, j] * q_j(d) < p_j(d)", "argmax(w / noise[s])", "-1 to the end",
                         "a prefix of the guesses"],
    "InputBatch.update": ["int64 [len(seqs)]", "self._new_row(seq, seqs)", "num_preemptions", "self.rollback",
                          "-1 past its end", "seq.block_table[known:]", "other rows are untouched"],
    "SampledTokens.feed": ["flat[:T]", "arrays.query_start[i]", "num_output_placeholders", "self.device[j]",
                           "no copy to the host"],
    "SharedStorageConnector.get_num_new_matched_tokens": [
        "a multiple of block_size", "min(seq.num_prompt_tokens, seq.num_tokens - 1) // B",
        "stopping at the first missing one", "match * B - num_computed_tokens", "not positive",
        "self.config.is_consumer", "prompt logprobs", "Reads only"],
    "rollback": ["num_spec_tokens", "has dropped by num_rejected", "block_manager.shrink", "ValueError"],
    "apply_token_bitmask": ["[S, V]", "[R, W] torch.int32", "ceil(V / 32)", "-inf", "least significant bit first",
                            "stay untouched", "bits past V are ignored"],
    "advance_matcher": ["all or nothing", "matcher.rollback(k)", "is_terminated", "ValueError", "never half-advanced",
                        "[] changes nothing"],
    "column_parallel": ["nn.Linear(in_features, out_features // N)", "rows rank*k .. (rank+1)*k - 1", "new tensors",
                        "Concatenated over the ranks", "ValueError"],
    "row_parallel": ["nn.Linear(in_features // N, out_features)", "columns rank*k .. (rank+1)*k - 1",
                     "rank 0's shard keeps a copy of it", "summed over the ranks", "ValueError"],
    "choose_core": ["index of the least loaded core", "the lowest index on a tie", "min(loads) + prefix_slack",
                    "Raises ValueError"],
    "new_delta": ["sent_tokens and sent_chars", "visible_text()", "only ever grows", "empty text and no tokens",
                  "None if none were asked for"],
    "vocab_parallel_lookup": ["[T, hidden]", "shard[input_ids[t] - start]", "zeros otherwise",
                              "Never reads shard outside its rows", "Summed over the ranks"],
}


def find_def(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part)
    return node


def student_docstrings() -> dict[str, tuple[str, str, ast.FunctionDef]]:
    """qualname -> (docstring in the source, docstring in the student copy, the stub's def)."""
    found = {}
    for path in sorted({ex.path for ex in EXERCISES}):
        source = (ROOT / path).read_text()
        stubbed = ast.parse(stub_source(source, {ex.qualname: ex for ex in EXERCISES if ex.path == path}, path))
        for ex in (ex for ex in EXERCISES if ex.path == path):
            stub = find_def(stubbed, ex.qualname)
            found[ex.qualname] = (ast.get_docstring(find_def(ast.parse(source), ex.qualname)) or "",
                                  ast.get_docstring(stub) or "", stub)
    return found


def test_every_exercise_has_a_contract_to_check():
    assert sorted(CONTRACTS) == sorted(ex.qualname for ex in EXERCISES)


@pytest.mark.parametrize("qualname", sorted(CONTRACTS))
def test_the_student_copy_states_each_exercise_contract(qualname):
    """The docstring alone (kept by the stub) names every argument, the output, and the errors
    and invariants the checks hold the student to, and refers to nothing the stub removes."""
    if qualname not in {ex.qualname for ex in EXERCISES}:
        pytest.fail(f"{qualname} is in CONTRACTS but not a registered exercise")
    solution_doc, student_doc, stub = student_docstrings()[qualname]
    assert student_doc, f"{qualname}: the stub has no docstring, so the student sees no specification"
    assert student_doc == solution_doc, f"{qualname}: the student copy changed the docstring"
    flat = " ".join(student_doc.split())
    arguments = [a.arg for a in stub.args.args + stub.args.kwonlyargs if a.arg != "self"]
    unnamed = [a for a in arguments if not re.search(rf"(?<!\w){re.escape(a)}\b", flat)]
    assert not unnamed, f"{qualname}: the docstring never says what {unnamed} are:\n{student_doc}"
    missing = [phrase for phrase in CONTRACTS[qualname] if phrase not in flat]
    assert not missing, f"{qualname}: the docstring does not state {missing}:\n{student_doc}"
    assert not re.search(r"\b(see|shown) below\b|\bbelow\)", flat), \
        f"{qualname}: the docstring points below, into code the stub removes:\n{student_doc}"


def unreachable_after_a_stub(tree: ast.AST) -> list[str]:
    """Statements that follow a stub's `raise NotImplementedError(...)` in the same block: a
    student who finds them after the raise may delete them as dead code."""
    found = []
    for node in ast.walk(tree):
        for block in (getattr(node, name, None) for name in ("body", "orelse", "finalbody")):
            for i, statement in enumerate(block if isinstance(block, list) else []):
                raised = statement.exc if isinstance(statement, ast.Raise) else None
                if isinstance(raised, ast.Call) and getattr(raised.func, "id", None) == "NotImplementedError":
                    found += [f"line {s.lineno}: {ast.unparse(s).splitlines()[0]}" for s in block[i + 1:]]
    return found


@pytest.mark.parametrize("path", sorted({ex.path for ex in EXERCISES}))
def test_no_stub_is_followed_by_code_that_a_student_must_keep(path):
    """In the student copy, the stub's raise is the last statement of its block: code the
    function needs after the exercise belongs inside the solution region (and its docstring)
    or before it."""
    stubbed = stub_source((ROOT / path).read_text(), {ex.qualname: ex for ex in EXERCISES if ex.path == path}, path)
    assert not unreachable_after_a_stub(ast.parse(stubbed)), \
        f"{path}: in the student copy these lines follow a stub's raise: {unreachable_after_a_stub(ast.parse(stubbed))}"


def test_unreachable_code_after_a_stub_is_found():
    stubbed = stub_source(SAMPLE.replace("    return y\n    # END SOLUTION\n", "    # END SOLUTION\n    return y\n"),
                          SAMPLE_EXERCISES)
    assert unreachable_after_a_stub(ast.parse(stubbed)) == ["line 5: return y"]
    assert unreachable_after_a_stub(ast.parse(stub_source(SAMPLE, SAMPLE_EXERCISES))) == []  # Pool.take's return None is reachable


def test_registry_entries_are_well_formed():
    for ex in EXERCISES:
        assert ex.chapter in NOTEBOOKS, ex
        assert (ROOT / ex.path).is_file(), f"{ex.label}: no file {ex.path}"
        assert ex.section.startswith(f"Exercise {int(ex.chapter[2:])}."), f"{ex.label}: section {ex.section!r}"
        assert ex.description and "\n" not in ex.description
    assert sorted({ex.chapter for ex in EXERCISES}) == sorted(NOTEBOOKS), "every chapter has exercises"


SAMPLE = '''\
def double(x):
    """Twice x."""
    # BEGIN SOLUTION
    y = x + x
    return y
    # END SOLUTION


class Pool:
    def take(self, n):
        if n:
            # BEGIN SOLUTION
            return n - 1
            # END SOLUTION
        return None
'''
SAMPLE_EXERCISES = {
    "double": Exercise("ch01", "sample", "double", "Exercise 1.9: doubling", "return twice x"),
    "Pool.take": Exercise("ch06", "sample", "Pool.take", "Exercise 6.9: taking", "take one"),
}


def test_find_regions_names_the_enclosing_function():
    regions = find_regions(SAMPLE)
    assert [(r.qualname, r.begin, r.end, r.indent) for r in regions] == [
        ("double", 3, 6, " " * 4), ("Pool.take", 12, 14, " " * 12)]


def test_stub_keeps_signature_and_docstring_and_raises_with_the_exercise_name():
    stubbed = stub_source(SAMPLE, SAMPLE_EXERCISES)
    assert "x + x" not in stubbed and "n - 1" not in stubbed and "SOLUTION" not in stubbed
    assert '    """Twice x."""\n    # YOUR CODE HERE' in stubbed
    assert "\n            raise NotImplementedError(" in stubbed  # the region's own indentation
    namespace: dict = {}
    exec(compile(stubbed, "sample", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"Exercise ch01 double: return twice x — see "
                                                  r"notebooks/01_naive_decode.ipynb, section 'Exercise 1.9: doubling'"):
        namespace["double"](2)
    with pytest.raises(NotImplementedError, match="ch06 Pool.take"):
        namespace["Pool"]().take(3)
    assert namespace["Pool"]().take(0) is None  # code outside the region is untouched


def test_only_the_given_exercises_are_stubbed():
    stubbed = stub_source(SAMPLE, {"double": SAMPLE_EXERCISES["double"]})
    assert "n - 1" in stubbed and "x + x" not in stubbed


@pytest.mark.parametrize("source, message", [
    ("def f():\n    # BEGIN SOLUTION\n    return 1\n", "never closed"),
    ("def f():\n    return 1\n    # END SOLUTION\n", "without a"),
    ("# BEGIN SOLUTION\nX = 1\n# END SOLUTION\n", "inside a function"),
    ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n", "inside the region"),
])
def test_malformed_regions_are_reported(source, message):
    with pytest.raises(ValueError, match=message):
        find_regions(source)


def test_make_refuses_the_repository_and_non_empty_folders(tmp_path):
    with pytest.raises(ValueError, match="repository"):
        make_student_copy(ROOT)
    with pytest.raises(ValueError, match="repository"):
        make_student_copy(ROOT.parent)
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        make_student_copy(tmp_path)
    with pytest.raises(ValueError, match="unknown chapters"):
        make_student_copy(tmp_path / "new", chapters=["ch9"])


@pytest.mark.floors
def test_exercises_list_prints_every_exercise(capsys, monkeypatch):
    from minivllm.entrypoints.cli import main

    monkeypatch.setenv("COLUMNS", "200")  # rich wraps long names in a narrow terminal

    main(["exercises", "list"])
    out = capsys.readouterr().out
    for ex in EXERCISES:
        assert ex.qualname in out and ex.section in out


def test_a_stub_of_another_chapter_names_the_exercise_to_do_first():
    message = exercises.lookup("causal_mask").message()
    note = exercises.prerequisite_note(message, ["ch02"])
    assert note == "This ch02 check calls exercise ch01 causal_mask, still a stub: do exercise ch01 causal_mask " \
                   "first (pytest -m ch01)"
    assert exercises.prerequisite_note(message, []).startswith("This check calls exercise ch01 causal_mask")
    assert exercises.prerequisite_note(message, ["ch01"]) is None  # its own chapter: the message says enough
    assert exercises.prerequisite_note("not implemented for bf16", ["ch02"]) is None  # not a stub


CHEAP_CHAPTERS = ["ch01", "ch02"]


@pytest.mark.floors
@solutions
def test_student_copy_fails_its_chapter_checks(tmp_path, request):
    """Generate the student copy and run chapters 1 and 2's checks inside it: they must fail,
    on the stubs (the main suite runs the same checks on the solution, where they pass)."""
    copy = tmp_path / "student"
    stubbed = make_student_copy(copy)
    assert {ex.label for ex in stubbed} == {ex.label for ex in EXERCISES}
    for ex in EXERCISES:
        source = (copy / ex.path).read_text()
        assert "BEGIN SOLUTION" not in source and f"Exercise {ex.label}:" in source, ex.label
    assert (copy / "tests" / "test_exercises.py").is_file() and (copy / "pyproject.toml").is_file()
    assert not (copy / ".git").exists()

    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    marker = " or ".join(CHEAP_CHAPTERS)
    # only the files holding their checks, as this session collected them (tests/collection.py)
    files = files_with_chapters(request.config.stash[ALL_ITEMS], set(CHEAP_CHAPTERS)) or ["tests"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", marker, "-q", "--tb=line", "-p", "no:cacheprovider",
                             *files], cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 1, f"the student copy's {marker} checks should fail:\n{out[-3000:]}"
    for ex in EXERCISES:
        if ex.chapter in CHEAP_CHAPTERS:
            assert f"NotImplementedError: Exercise {ex.label}:" in out, f"no check reached {ex.label}:\n{out[-3000:]}"
    # Chapter 2's cached decode builds chapter 1's causal mask: its failure says to do that first.
    assert "NotImplementedError: This ch02 check calls exercise ch01 causal_mask, still a stub: do exercise ch01 " \
           "causal_mask first" in out, f"no ch02 check named its ch01 prerequisite:\n{out[-3000:]}"


@solutions
def test_student_copy_of_one_chapter_keeps_the_others(tmp_path):
    copy = tmp_path / "student"
    make_student_copy(copy, chapters=["ch04"])
    masks = (copy / "minivllm/attention/masks.py").read_text()
    assert "Exercise ch04 block_diagonal_mask" in masks and "Exercise ch01" not in masks
    assert "# BEGIN SOLUTION" in masks  # chapter 1's solution is still there, markers included


# ---- Each chapter's checks depend only on its own and earlier chapters' exercises ----

CHAPTERS = sorted({ex.chapter for ex in EXERCISES})


@pytest.fixture(scope="module")
def classroom(tmp_path_factory):
    """One copy of the repository, made once, whose exercise files each check rewrites: the
    solutions of the chapters it keeps, the stubs of the others."""
    copy = tmp_path_factory.mktemp("classroom") / "repo"
    make_student_copy(copy, chapters=[])  # nothing stubbed yet
    sources = {path: (copy / path).read_text() for path in {ex.path for ex in EXERCISES}}
    return copy, sources


def stub_from(copy, sources: dict[str, str], first: str) -> None:
    """In the copy, stub every exercise of chapter `first` and later; keep the earlier solutions.
    The chapters after `first` are also listed in the copy's stubbed_chapters.txt, so that a
    program a check starts (a script, the CLI) runs the engine as of `first`, as the checks
    themselves do in-process (conftest's LATER_DEFAULTS) and as a student's copy does."""
    for path, source in sources.items():
        stubbed = {ex.qualname: ex for ex in EXERCISES if ex.path == path and ex.chapter >= first}
        (copy / path).write_text(stub_source(source, stubbed, path))
    later = sorted({ex.chapter for ex in EXERCISES if ex.chapter > first})
    (copy / STUBBED_CHAPTERS).write_text("".join(f"{chapter}\n" for chapter in later))


def check_outcomes(report) -> list[tuple[str, list[str], str | None]]:
    """(test id, its chapters, the text of its failure or None) for every check a junit report holds."""
    import xml.etree.ElementTree as ET

    found = []
    for case in ET.parse(report).iter("testcase"):
        chapters = next((p.get("value", "").split() for p in case.iter("property") if p.get("name") == "chapters"), [])
        failed = [f for f in case if f.tag in ("failure", "error")]
        text = "\n".join((f.get("message") or "") + "\n" + (f.text or "") for f in failed) if failed else None
        found.append((f"{case.get('classname')}::{case.get('name')}", chapters, text))
    return found


@pytest.mark.floors
@solutions
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_chapter_needs_only_its_own_and_earlier_exercises(classroom, chapter, request):
    """With `chapter` and every later chapter stubbed (earlier ones solved): the previous
    chapter's checks all pass, so none of them needs a later exercise; and every check of
    `chapter` that fails names one of this chapter's exercises. Run over every chapter, this is
    the classroom's promise: `pytest -m chNN` fails only on chapter NN's stubs and earlier ones,
    and says which. (Not every stub need be reached: chapter 4's stage stops on cu_seqlens
    before it calls RaggedAttention.__call__.)"""
    copy, sources = classroom
    stub_from(copy, sources, chapter)
    before = CHAPTERS[CHAPTERS.index(chapter) - 1] if chapter != CHAPTERS[0] else None
    report = copy / f"report-{chapter}.xml"
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    marker = f"{before} or {chapter}" if before else chapter
    # Only the files that hold these chapters' checks, as this session collected them: the run
    # selects the same checks, without importing and collecting the whole suite for each chapter
    # (about half the work of an early chapter's run).
    files = files_with_chapters(request.config.stash[ALL_ITEMS], {before, chapter} - {None}) or ["tests"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", marker, "-q", "--tb=line", "-p", "no:cacheprovider",
                             f"--junitxml={report}", *files], cwd=copy, env=env, capture_output=True, text=True,
                            timeout=1100)
    outcomes = check_outcomes(report) if report.is_file() else []
    assert outcomes, f"no checks ran for -m '{marker}':\n{(result.stdout + result.stderr)[-3000:]}"
    broken = [(test, text) for test, chapters, text in outcomes if before in chapters and text is not None]
    assert not broken, (f"{len(broken)} {before} checks fail while {chapter} and later chapters are stubs (they must "
                        "depend only on chapters up to theirs); the first:\n"
                        + "\n\n".join(f"{test}\n{text[:1500]}" for test, text in broken[:3]))
    mine = [ex for ex in EXERCISES if ex.chapter == chapter]
    # (a check selected through its module's marker whose own marker names a later chapter is
    # that chapter's: its stub may be another one)
    unnamed = [(test, text) for test, chapters, text in outcomes
               if chapter in chapters and text is not None and not any(f"Exercise {ex.label}:" in text for ex in mine)]
    assert not unnamed, (f"{len(unnamed)} {chapter} checks fail without naming one of the chapter's exercises "
                         f"({', '.join(ex.qualname for ex in mine)}); the first:\n"
                         + "\n\n".join(f"{test}\n{text[:1500]}" for test, text in unnamed[:3]))


STUDENT_SCRIPT = """
from minivllm import LLM, SamplingParams
out = LLM().generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 8, out
"""


@pytest.mark.floors
@solutions
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("first_stub", ["ch12", "ch16"])
def test_a_student_copy_runs_the_chapters_it_has_reached_outside_pytest(tmp_path, monkeypatch, first_stub):
    """With chapters `first_stub`..16 stubbed and the earlier ones solved, outside pytest (no
    conftest): a plain script's LLM().generate runs, and the notebook of the chapter before the
    first stub executes top to bottom. The copy's engine is the one its solved chapters built
    (config/engine.py's STUBBED_CHAPTERS_FILE): without that, chapter 16's persistent batch and
    chapter 11's prefix cache, both on by default, stop on their stubs."""
    nbformat, nbclient = pytest.importorskip("nbformat"), pytest.importorskip("nbclient")
    copy = tmp_path / "student"
    make_student_copy(copy, chapters=[chapter for chapter in NOTEBOOKS if chapter >= first_stub])
    assert (copy / exercises.STUBBED_CHAPTERS).read_text().split()[0] == first_stub
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", STUDENT_SCRIPT], cwd=copy, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"LLM().generate in a copy stubbed from {first_stub}:\n{result.stderr[-3000:]}"
    reached = CHAPTERS[CHAPTERS.index(first_stub) - 1]
    notebook = copy / NOTEBOOKS[reached]
    for name, value in env.items():  # the notebook's kernel inherits them
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nbformat.read(notebook, as_version=4), timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell, on the first failure
