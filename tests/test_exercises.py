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

from minivllm import exercises
from minivllm.exercises import EXERCISES, NOTEBOOKS, Exercise, find_regions, make_student_copy, stub_source

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
                           "one block per running request", "out.add(seq, n)"],
    "filter_logits": ["[S, V]", "-inf", "softmax over the kept", "always stays", "left unchanged"],
    "merge_partials": ["[..., P]", "[..., P, D]", "[..., D]", "-inf"],
    "bucket_for": ["ascending", ">= num_seqs", "ValueError"],
    "GraphRunner.prepare": ["self.static", "self.pad_block", "padding", "rewritten in place"],
    "rope_cos_sin_table": ["[max_positions, D]", "[cos(p * inv_freq), sin(p * inv_freq)]", "bit for bit", "ValueError"],
    "new_deltas": ["c.finish_reason", "returns []", "that text goes out with c's next delta"],
    "find_stop_string": ["None if none", "len(s) - 1", "listed first wins"],
    "block_hashes": ["len(token_ids) // block_size", "hash_block(", "partly filled last block has no hash"],
    "PrefixCachingBlockManager.longest_cached_prefix": ["first hash not in self.cached", "Reads only", "never a gap"],
    "PrefixCachingBlockManager.release": ["young end of self.free", "last block first", "free + owned blocks = the pool"],
    "column_parallel": ["nn.Linear(in_features, out_features // N)", "rows rank*k .. (rank+1)*k - 1", "new tensors",
                        "Concatenated over the ranks", "ValueError"],
    "row_parallel": ["nn.Linear(in_features // N, out_features)", "columns rank*k .. (rank+1)*k - 1",
                     "rank 0's shard keeps a copy of it", "summed over the ranks", "ValueError"],
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


def test_exercises_list_prints_every_exercise(capsys, monkeypatch):
    from minivllm.cli import main

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


@solutions
def test_student_copy_fails_its_chapter_checks(tmp_path):
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
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", marker, "-q", "--tb=line", "-p", "no:cacheprovider"],
                            cwd=copy, env=env, capture_output=True, text=True, timeout=600)
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
