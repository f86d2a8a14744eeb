"""Classroom exercises: the registry, and the tool that writes a student copy of the repository.

The heart of each chapter is marked in the package source with the nbgrader convention: the
lines of a function body between `# BEGIN SOLUTION` and `# END SOLUTION` are the solution.

    minivllm exercises list          the exercises, chapter by chapter
    minivllm exercises make DIR      a copy of the repository where every solution is a stub

A stub keeps the function's signature and docstring and raises NotImplementedError naming the
exercise and the notebook section that explains it. Students run their chapter's checks with
`pytest -m ch04`; they fail until the exercises are written. See docs/instructors.md.

EXERCISES below and the markers in the source must agree both ways (tests/test_exercises.py).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"  # a marker is a line holding exactly this
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # minivllm/ (this file is minivllm/course/exercises.py)
PROJECT_ROOT = PACKAGE_DIR.parent
STUBBED_CHAPTERS = "minivllm/config/stubbed_chapters.txt"  # read by config/engine.py (config.engine.STUBBED_CHAPTERS_FILE)

NOTEBOOKS = {
    "ch01": "notebooks/01_naive_decode.ipynb",
    "ch02": "notebooks/02_kv_cache.ipynb",
    "ch03": "notebooks/03_static_batching.ipynb",
    "ch04": "notebooks/04_ragged_batching.ipynb",
    "ch05": "notebooks/05_chunked_prefill.ipynb",
    "ch06": "notebooks/06_paged_kv_cache.ipynb",
    "ch07": "notebooks/07_continuous_batching.ipynb",
    "ch08": "notebooks/08_triton_kernel.ipynb",
    "ch09": "notebooks/09_cuda_graphs.ipynb",
    "ch10": "notebooks/10_serving.ipynb",
    "ch11": "notebooks/11_prefix_caching.ipynb",
    "ch12": "notebooks/12_speculative_decoding.ipynb",
    "ch13": "notebooks/13_structured_outputs.ipynb",
    "ch14": "notebooks/14_tensor_parallelism.ipynb",
    "ch15": "notebooks/15_engine_core_process.ipynb",
    "ch16": "notebooks/16_async_scheduling.ipynb",
    "ch17": "notebooks/17_disaggregated_prefill.ipynb",
}


@dataclass(frozen=True)
class Exercise:
    chapter: str  # "ch01" .. "ch13": also the pytest marker that selects its checks
    module: str  # where the solution region is, e.g. "minivllm.attention.masks"
    qualname: str  # the function holding it, e.g. "causal_mask" or "BlockManager.grow"
    section: str  # the heading of the notebook section that explains it
    description: str  # one line: what to implement

    @property
    def notebook(self) -> str:
        return NOTEBOOKS[self.chapter]

    @property
    def path(self) -> str:
        """The module's file, relative to the project root."""
        return self.module.replace(".", "/") + ".py"

    @property
    def label(self) -> str:
        return f"{self.chapter} {self.qualname}"

    def message(self) -> str:
        """What the student's stub raises."""
        return (f"Exercise {self.label}: {self.description} — see {self.notebook}, section '{self.section}'. "
                f"Check it with: pytest -m {self.chapter}")


EXERCISES: list[Exercise] = [
    Exercise("ch01", "minivllm.attention.masks", "causal_mask", "Exercise 1.1: the causal mask",
             "build the [n, n] boolean mask where token i sees tokens 0..i"),
    Exercise("ch02", "minivllm.stages.kv_cache", "append_kv", "Exercise 2.1: append to the cache",
             "write the step's K or V rows into the cache and return its filled part"),
    Exercise("ch03", "minivllm.stages.static_batch", "left_pad", "Exercise 3.1: left padding",
             "token ids and positions of prompts left-padded into a [B, L] rectangle"),
    Exercise("ch03", "minivllm.attention.masks", "padded_causal_mask", "Exercise 3.2: the padded causal mask",
             "the [B, L, L] mask that is causal, hides padding keys, and lets padding see itself"),
    Exercise("ch03", "minivllm.stages.static_batch", "count_waste", "Exercise 3.3: counting the waste",
             "token slots computed by a static batch, and how many went to padding or finished rows"),
    Exercise("ch04", "minivllm.stages.ragged_batch", "cu_seqlens", "Exercise 4.1: cu_seqlens",
             "the offsets [0, n0, n0 + n1, ..., T] of segments laid end to end"),
    Exercise("ch04", "minivllm.attention.masks", "block_diagonal_mask", "Exercise 4.2: the block-diagonal mask",
             "the [T, T] mask of a flat run: causal within each sequence, blind to the others"),
    Exercise("ch04", "minivllm.stages.ragged_batch", "RaggedAttention.__call__",
             "Exercise 4.3: attention segment by segment",
             "attend each segment of the flat run to its own sequence's KV cache"),
    Exercise("ch05", "minivllm.attention.masks", "chunk_mask", "Exercise 5.1: the chunk mask",
             "the [q_len, past + q_len] mask of a chunk after `past` cached tokens"),
    Exercise("ch05", "minivllm.stages.chunked_prefill", "plan_step", "Exercise 5.2: planning a step",
             "decodes first, then prefill chunks, under the per-step token budget"),
    Exercise("ch06", "minivllm.attention.paged", "slot_mapping", "Exercise 6.1: slot mapping",
             "the pool slot of each token position, through the block table"),
    Exercise("ch06", "minivllm.attention.paged", "gather_kv", "Exercise 6.2: gathering a sequence's KV",
             "read a sequence's cached K or V back out of the pool, in order"),
    Exercise("ch06", "minivllm.core.block_manager", "BlockManager.grow", "Exercise 6.3: block allocation",
             "append free blocks to a block table until it holds num_tokens tokens"),
    Exercise("ch07", "minivllm.core.scheduler", "Scheduler.schedule", "Exercise 7.1: one scheduler step",
             "plan one step under the token budget: running first, then waiting, preempting when blocks run out"),
    Exercise("ch07", "minivllm.worker.sampler", "filter_logits", "Exercise 7.2: top-k and top-p",
             "keep each row's top_k logits, then the smallest set of tokens holding top_p probability"),
    Exercise("ch08", "minivllm.attention.triton_kernels", "merge_partials",
             "Exercise 8.1: merging partial softmaxes",
             "combine per-partition (max, sum, acc) partial attention results into the full result"),
    Exercise("ch09", "minivllm.worker.cuda_graphs", "bucket_for", "Exercise 9.1: the batch-size bucket",
             "the smallest captured batch size that holds a step's sequences"),
    Exercise("ch09", "minivllm.worker.cuda_graphs", "GraphRunner.prepare", "Exercise 9.2: preparing a replay",
             "pad a decode step to its bucket and copy it into the static buffer a captured graph reads"),
    Exercise("ch09", "minivllm.fused.forward", "rope_cos_sin_table", "Exercise 9.3: the RoPE cos/sin table",
             "the [max_positions, D] table whose row p is [cos(p * inv_freq), sin(p * inv_freq)] in dtype"),
    Exercise("ch10", "minivllm.entrypoints.openai.sse", "new_deltas", "Exercise 10.1: engine outputs as stream deltas",
             "the text and tokens of each completion that the client has not been sent yet"),
    Exercise("ch10", "minivllm.engine.detokenizer", "find_stop_string", "Exercise 10.2: stop strings across tokens",
             "find the earliest stop string that ends in the new text, including one that began in the text before it"),
    Exercise("ch11", "minivllm.core.prefix_cache", "block_hashes", "Exercise 11.1: the block hash chain",
             "the chained hashes of a token list's full blocks"),
    Exercise("ch11", "minivllm.core.prefix_cache", "PrefixCachingBlockManager.longest_cached_prefix",
             "Exercise 11.2: the longest cached prefix", "the blocks holding the longest run of leading hashes in the cache"),
    Exercise("ch11", "minivllm.core.prefix_cache", "PrefixCachingBlockManager.release",
             "Exercise 11.3: reference-counted release",
             "let go of a table's blocks: a block is free only when its last owner lets go"),
    Exercise("ch12", "minivllm.core.spec_decode.ngram", "propose_ngram", "Exercise 12.1: prompt lookup",
             "guess the next tokens: what followed the last n tokens where they occurred before"),
    Exercise("ch12", "minivllm.core.spec_decode.rejection", "rejection_sample", "Exercise 12.2: rejection sampling",
             "keep a prefix of the guesses and draw one more token, exactly in the target's distribution"),
    Exercise("ch12", "minivllm.core.spec_decode.rollback", "rollback", "Exercise 12.3: the rollback",
             "take back a verify step's rejected guesses: the computed count, and the blocks that held them"),
    Exercise("ch13", "minivllm.structured_outputs.bitmask", "apply_token_bitmask",
             "Exercise 13.1: applying a bitmask",
             "unpack each row's int32 bitmask words and set the forbidden logits to -inf"),
    Exercise("ch13", "minivllm.structured_outputs.matcher", "advance_matcher",
             "Exercise 13.2: advancing a matcher",
             "accept a step's tokens in order, all or nothing: roll back and raise if the grammar refuses one"),
    Exercise("ch14", "minivllm.distributed.layers", "column_parallel", "Exercise 14.1: splitting a layer by columns",
             "rank r's share of a linear layer's output features: a smaller nn.Linear"),
    Exercise("ch14", "minivllm.distributed.layers", "row_parallel", "Exercise 14.2: splitting a layer by rows",
             "rank r's share of a linear layer's input features, whose partial sums the all-reduce adds"),
    Exercise("ch14", "minivllm.distributed.layers", "vocab_parallel_lookup",
             "Exercise 14.3: the vocabulary-parallel embedding",
             "look up only the tokens this rank holds, zeros for the others"),
    Exercise("ch14", "minivllm.engine.data_parallel", "choose_core", "Exercise 14.4: the least-loaded router",
             "which of N engine cores takes a request: the least loaded, unless one nearly as idle holds its prefix"),
    Exercise("ch15", "minivllm.engine.output_processor", "new_delta", "Exercise 15.1: the output processor's delta",
             "what one completion produced since its last DELTA output: new tokens, new text, their logprobs"),
    Exercise("ch16", "minivllm.worker.input_batch", "InputBatch.update", "Exercise 16.1: applying a step's differences",
             "keep each running request's row of block tables up to date, writing only the blocks it gained"),
    Exercise("ch16", "minivllm.worker.sampled_tokens", "SampledTokens.feed",
             "Exercise 16.2: feeding the sampled ids on the device",
             "write last step's sampled ids over this step's placeholders, on the device, without the host"),
    Exercise("ch17", "minivllm.kv_transfer.shared_storage", "SharedStorageConnector.get_num_new_matched_tokens",
             "Exercise 17.1: what the consumer can load",
             "how many prompt tokens the stored blocks supply: the leading full blocks with a file, never the last token"),
]


def prerequisite_note(message: str, chapters: Iterable[str]) -> str | None:
    """For a check of `chapters` (its pytest markers) that stopped on a stub's NotImplementedError
    `message`: one line saying which exercise of another chapter to do first. None when the stub
    is one of the check's own chapters (its message says enough) or the error is not a stub's."""
    found = re.match(r"Exercise (ch\d+) (\S+):", message)
    chapters = sorted(set(chapters))
    if found is None or found.group(1) in chapters:
        return None
    chapter, qualname = found.groups()
    check = f"This {' / '.join(chapters)} check" if chapters else "This check"
    return (f"{check} calls exercise {chapter} {qualname}, still a stub: do exercise {chapter} {qualname} first "
            f"(pytest -m {chapter})")


def by_chapter(exercises: Iterable[Exercise] = EXERCISES) -> dict[str, list[Exercise]]:
    chapters: dict[str, list[Exercise]] = {}
    for ex in exercises:
        chapters.setdefault(ex.chapter, []).append(ex)
    return dict(sorted(chapters.items()))


# ------------------------------------------------------------------------------------------
# Finding solution regions in source code
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """Lines begin..end (1-based, the two marker lines included) inside function `qualname`."""

    qualname: str
    begin: int
    end: int
    indent: str


def _functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(qualname, first line, last line) of every function, methods as Class.method."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno or child.lineno))
                visit(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def find_regions(source: str, filename: str = "<source>") -> list[Region]:
    """Every solution region of a module's source, with the function that holds it."""
    lines = source.splitlines()
    functions = _functions(ast.parse(source, filename))
    regions, begin = [], None
    for number, line in enumerate(lines, start=1):
        marker = line.strip()
        if marker == BEGIN:
            if begin is not None:
                raise ValueError(f"{filename}:{number}: {BEGIN} inside the region opened at line {begin}")
            begin = number
        elif marker == END:
            if begin is None:
                raise ValueError(f"{filename}:{number}: {END} without a {BEGIN}")
            # A function's last line is its last statement: a trailing END comment lies past it.
            inside = [f for f in functions if f[1] < begin <= f[2]]
            if not inside:
                raise ValueError(f"{filename}:{begin}: a solution region must be inside a function body")
            qualname = max(inside, key=lambda f: f[1])[0]  # the innermost function
            indent = lines[begin - 1][: len(lines[begin - 1]) - len(lines[begin - 1].lstrip())]
            regions.append(Region(qualname, begin, number, indent))
            begin = None
    if begin is not None:
        raise ValueError(f"{filename}:{begin}: {BEGIN} is never closed by {END}")
    return regions


def package_regions(root: Path = PROJECT_ROOT) -> dict[str, list[Region]]:
    """Regions of every module of the package under `root`, keyed by module name."""
    found = {}
    for path in sorted((root / "minivllm").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        regions = find_regions(path.read_text(), str(path))
        if regions:
            found[".".join(path.relative_to(root).with_suffix("").parts)] = regions
    return found


def stub_source(source: str, exercises: dict[str, Exercise], filename: str = "<source>") -> str:
    """The source with every region replaced by a stub. `exercises` maps qualname -> Exercise
    for this module; a region whose function is not in it is left as it is."""
    lines = source.splitlines(keepends=True)
    for region in reversed(find_regions(source, filename)):  # bottom up: line numbers stay valid
        ex = exercises.get(region.qualname)
        if ex is None:
            continue
        message = ex.message()
        literal = f'"{message}"' if '"' not in message and "\\" not in message else repr(message)
        stub = [f"{region.indent}# YOUR CODE HERE ({ex.label}: {ex.description})\n",
                f"{region.indent}raise NotImplementedError({literal})\n"]
        lines[region.begin - 1: region.end] = stub
    stubbed = "".join(lines)
    ast.parse(stubbed, filename)  # a stub must never break the module
    return stubbed


# ------------------------------------------------------------------------------------------
# The student copy
# ------------------------------------------------------------------------------------------

SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}


def project_files(root: Path = PROJECT_ROOT) -> list[Path]:
    """The files of the project, relative to root: what git tracks plus untracked files it
    does not ignore; without git, a walk that skips hidden folders, caches and build outputs."""
    try:
        listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                                 cwd=root, capture_output=True, check=True, text=True).stdout
        files = [Path(name) for name in listing.split("\0") if name]
        return sorted(f for f in files if (root / f).is_file())  # tracked files may be deleted
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info"))
        files += [Path(folder, n).relative_to(root) for n in names if not n.endswith((".pyc", ".pyo"))]
    return sorted(files)


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def make_student_copy(dest: Path | str, chapters: Iterable[str] | None = None, root: Path = PROJECT_ROOT,
                      exercises: Iterable[Exercise] = EXERCISES) -> list[Exercise]:
    """Copy the project at `root` to `dest` with the solutions of `chapters` (default: all)
    replaced by stubs. `dest` must not exist or be empty, and may not hold the project.
    Returns the exercises that were stubbed."""
    dest, root = Path(dest).resolve(), Path(root).resolve()
    if not (root / "pyproject.toml").is_file() or not (root / "minivllm").is_dir():
        raise ValueError(f"{root} is not a minivllm source checkout (an installed package cannot be copied)")
    if _is_within(root, dest):
        raise ValueError(f"refusing to write the student copy into {dest}: it holds the repository itself")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"refusing to write into {dest}: it is not an empty folder")
    files = project_files(root)
    if _is_within(dest, root):
        try:
            ignored = subprocess.run(["git", "check-ignore", "-q", str(dest.relative_to(root))], cwd=root,
                                     capture_output=True).returncode == 0
        except OSError:
            ignored = False
        if not ignored:
            raise ValueError(f"refusing to write into {dest}: it is inside the repository and not ignored by git; "
                             "choose a folder outside it (or one listed in .gitignore, like student/)")
    wanted = set(chapters) if chapters is not None else {ex.chapter for ex in exercises}
    unknown = wanted - set(NOTEBOOKS)
    if unknown:
        raise ValueError(f"unknown chapters {sorted(unknown)}; use {', '.join(NOTEBOOKS)}")
    chosen = [ex for ex in exercises if ex.chapter in wanted]
    per_file: dict[str, dict[str, Exercise]] = {}
    for ex in chosen:
        per_file.setdefault(ex.path, {})[ex.qualname] = ex
    missing = [p for p in per_file if Path(p) not in set(files)]
    if missing:
        raise ValueError(f"exercise modules not found in the project: {missing}")
    dest.mkdir(parents=True, exist_ok=True)
    for relative in files:
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        key = relative.as_posix()
        if key in per_file:
            source = (root / relative).read_text()
            target.write_text(stub_source(source, per_file[key], key))
            shutil.copymode(root / relative, target)
        else:
            shutil.copy2(root / relative, target)
    # The engine as of the student's chapter (config/engine.py): a default that a stubbed chapter turned
    # on is off in this copy, for notebooks, scripts, LLM() and the server alike, not only under pytest.
    stubbed = sorted({ex.chapter for ex in chosen})
    if stubbed:
        (dest / STUBBED_CHAPTERS).write_text("\n".join(stubbed) + "\n")
    return chosen


# ------------------------------------------------------------------------------------------
# For notebooks: an exercise's signature and docstring, never its solution
# ------------------------------------------------------------------------------------------


def lookup(name: str) -> Exercise:
    """An exercise by qualname ("causal_mask", "BlockManager.grow")."""
    matches = [ex for ex in EXERCISES if ex.qualname == name]
    if len(matches) != 1:
        raise KeyError(f"no exercise named {name!r}; see `minivllm exercises list`")
    return matches[0]


def signature(ex: Exercise) -> str:
    """The function's def line(s) and docstring, with `...` for its body."""
    obj = importlib.import_module(ex.module)
    for part in ex.qualname.split("."):
        obj = getattr(obj, part)
    source = textwrap.dedent(inspect.getsource(obj))
    fn = ast.parse(source).body[0]
    body = fn.body[0]
    has_doc = isinstance(body, ast.Expr) and isinstance(getattr(body, "value", None), ast.Constant) \
        and isinstance(body.value.value, str)
    last = body.end_lineno if has_doc else body.lineno - 1
    head = source.splitlines()[:last]
    while not has_doc and head[-1].strip().startswith("#"):  # comments before the body (the marker)
        head.pop()
    indent = " " * body.col_offset
    return "\n".join(head + [f"{indent}...  # your code here"])


# ------------------------------------------------------------------------------------------
# The command line: `minivllm exercises list | make DIR`
# ------------------------------------------------------------------------------------------


def print_list() -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="minivllm exercises (check a chapter with: pytest -m chNN)")
    table.add_column("chapter")
    table.add_column("exercise (file)", overflow="fold")
    table.add_column("notebook section", overflow="fold")
    table.add_column("what to implement")
    for chapter, exercises in by_chapter().items():
        for i, ex in enumerate(exercises):
            table.add_row(chapter if i == 0 else "", f"[bold]{escape(ex.qualname)}[/]\n[dim]{escape(ex.path)}[/]",
                          f"{escape(ex.section)}\n[dim]{escape(ex.notebook)}[/]", escape(ex.description),
                          end_section=i == len(exercises) - 1)
    Console().print(table)


def _run(args: argparse.Namespace) -> None:
    if args.action == "list":
        print_list()
        return
    chapters = args.chapters.split(",") if args.chapters else None
    try:
        stubbed = make_student_copy(args.dir, chapters)
    except ValueError as error:
        raise SystemExit(f"minivllm exercises make: {error}") from None
    print(f"wrote a student copy to {args.dir} with {len(stubbed)} exercises stubbed "
          f"({', '.join(sorted({ex.chapter for ex in stubbed}))}).")
    first = min((ex.chapter for ex in stubbed), default="ch01")
    print(f"Students: cd {args.dir} && pip install -e '.[dev]' && pytest -m {first}")


def add_subparser(commands: argparse._SubParsersAction) -> None:
    """`minivllm exercises ...`, added to the CLI by cli.py."""
    parser = commands.add_parser("exercises", help="list the classroom exercises or write a student copy")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the exercises, chapter by chapter")
    make = actions.add_parser("make", help="copy the repository to DIR with every solution replaced by a stub")
    make.add_argument("dir", metavar="DIR", help="an empty or new folder, outside the repository")
    make.add_argument("--chapters", default=None,
                      help="comma-separated chapters to stub, e.g. ch03,ch04 (default: all)")
    parser.set_defaults(run=_run)
