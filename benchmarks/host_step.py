"""Host time of one decode step at a GPU's batch size, phase by phase (chapter 9).

    python benchmarks/host_step.py [--batch-size 256] [--context 600] [--steps 40] [--rounds 3]
                                   [--baseline REV] [--threads 1] [--clock wall|cpu]

On a GPU, with CUDA graphs, the device runs a decode step of Qwen3-0.6B at batch 256 in a few
milliseconds, and every microsecond of Python per sequence is 0.26 ms of step time that the GPU
may spend waiting. This measures that Python alone, on the CPU: an engine with batch-size
requests that are all decoding (contexts within 10 % of --context, prompt and output tokens
random, greedy, EOS ignored, none finishing before the last measured step (each step is checked
to run the whole batch), each output returned when it finishes as `LLM.generate` asks, prefix
caching on as by default) whose model never runs: the
runner builds the step's inputs exactly as the engine does and hands the sampler fixed logits
(over a 256-token vocabulary: on a GPU the argmax over a real vocabulary is device work, and
here it would hide the host's own).
Per step, the median over --steps decode steps:

- schedule: `Scheduler.schedule` (with the block manager's and the prefix cache's bookkeeping);
- prepare (eager): the step's arrays (chapter 16's persistent batch, `InputBatch.step_arrays`,
  where the tree has one; else chapter 9's `build_step_arrays`), the packed buffer and its views
  (`device_step`);
- prepare (graph): the same arrays padded to the step's batch-size bucket, as a graph replay
  does;
- sample: the sampler (all rows greedy: an argmax and the tokens back to the host);
- finish: the rest of `LLMEngine.step`: counting computed tokens, appending the tokens,
  finishing and retiring requests, building outputs.

--clock cpu times each phase in the CPU time of the measuring thread (time.thread_time) instead
of wall time: on a shared machine, time spent waiting for a core is then not counted (the host
work measured here never waits for anything else).

With --baseline REV, the same measurement also runs on the code of git revision REV (exported
with `git archive`), the two alternating round by round, each in a fresh process: the ratios
come from one run on one machine state, which is what a shared machine allows. Results:
benchmarks/results/09_host_step_cpu.json (--results names another: chapter 16's comparison of the
persistent batch with the revision before it is 16_host_step_cpu).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("schedule", "prepare (eager)", "prepare (graph)", "sample", "finish", "step")
# A decoder that is never run: only its shape matters (the KV pool, the vocabulary of the logits).
CONFIG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=256, hidden_size=64,
              intermediate_size=128, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
              torch_dtype="float32", eos_token_id=0)


def measure(batch_size: int, context: int, steps: int, seed: int, clock_name: str = "wall") -> dict[str, Any]:
    """Milliseconds per decode step, by phase, of whatever minivllm this interpreter imports."""
    import torch

    import minivllm
    from minivllm import LLMEngine, SamplingParams
    from minivllm.worker.cuda_graphs import bucket_for, graph_batch_sizes
    from minivllm.worker.prepare import build_step_arrays, device_step, to_device
    from minivllm.request.sampling_params import RequestOutputKind

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(CONFIG))
        model = minivllm.load_model(Path(folder) / "config.json", device="cpu", dtype=torch.float32)
    rng = random.Random(seed)
    spread = context // 10
    # Nobody may finish before the measured steps end: the prompts take up to prefill_steps steps
    # (each leaves at least budget - batch_size tokens of its budget to them), and the requests
    # admitted first decode all the while.
    budget = max(2048, 2 * batch_size)
    prefill_steps = -(-batch_size * (context + spread) // (budget - batch_size)) + 1
    max_tokens = prefill_steps + steps + 8
    blocks = batch_size * (-(-(context + spread + max_tokens) // 16) + 1)
    engine = LLMEngine(model, num_kv_blocks=blocks, max_num_seqs=batch_size, max_num_batched_tokens=budget,
                       max_model_len=CONFIG["max_position_embeddings"])
    logits = torch.randn(batch_size, CONFIG["vocab_size"], generator=torch.Generator().manual_seed(seed))
    buckets = graph_batch_sizes(batch_size)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter

    # Chapter 16's persistent batch where the tree has one (rows kept across steps); chapter 9's
    # build_step_arrays, from the requests' lists every step, where it has not.
    batch = getattr(engine.core.runner, "batch", None)

    def arrays_of(seqs, num_new, num_rows=None, pad_block=None):
        if batch is not None:
            return batch.step_arrays(seqs, num_new, num_rows, pad_block)
        return build_step_arrays(seqs, num_new, 16, num_rows=num_rows, pad_block=pad_block)

    def run(schedule, previous=None):  # the runner's prepare, then fixed logits for the rows that sample
        seqs, num_new = schedule.seqs, schedule.num_new_tokens
        start = clock()
        arrays = arrays_of(seqs, num_new)
        device_step(arrays, to_device(arrays.pack(), model.device))
        middle = clock()
        if all(n == 1 for n in num_new):
            arrays_of(seqs, num_new, num_rows=bucket_for(len(seqs), buckets), pad_block=blocks).pack()
        times["prepare (eager)"].append(middle - start)
        times["prepare (graph)"].append(clock() - middle)
        return arrays.samplers, logits[:len(arrays.samplers)], {}

    schedule_fn = engine.core.scheduler.schedule
    # Chapter 16's engine asks the sampler for tokens left on the device (Sampler.sample); before, it called it.
    sampler = getattr(engine.core.sampler, "sample", engine.core.sampler)

    batch_sizes: list[int] = []

    def timed_schedule():
        start = clock()
        out = schedule_fn()
        times["schedule"].append(clock() - start)
        batch_sizes.append(len(out.seqs))
        return out

    def timed_sample(*args):
        start = clock()
        out = sampler(*args)
        times["sample"].append(clock() - start)
        return out

    engine.core.runner.run, engine.core.scheduler.schedule = run, timed_schedule
    if sampler is engine.core.sampler:
        engine.core.sampler = timed_sample
    else:
        engine.core.sampler.sample = timed_sample
    # As LLM.generate (the benchmarks) asks: the output once, when the request finishes.
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(batch_size):
        engine.add_request(prompt=[rng.randrange(1, CONFIG["vocab_size"]) for _ in range(rng.randint(context - spread,
                                                                                           context + spread))], params=params)
    seqs = [seq for group in engine.core.requests.values() for seq in group.seqs]
    while not all(s.num_computed_tokens == s.num_tokens - 1 and s.output_token_ids for s in seqs):
        engine.step()  # the prompts, chunk by chunk: not measured
    for phase in PHASES:
        times[phase].clear()
    batch_sizes.clear()
    for _ in range(steps):
        start = clock()
        engine.step()
        times["step"].append(clock() - start)
    assert len(times["step"]) == len(times["schedule"]) == steps, "a step was not a decode step of the whole batch"
    assert batch_sizes == [batch_size] * steps, f"steps of {sorted(set(batch_sizes))} sequences, not all {batch_size}"
    # An engine step prepares once: the graph-padded prepare measured beside it is not part of it.
    times["step"] = [t - g for t, g in zip(times["step"], times["prepare (graph)"])]
    times["finish"] = [t - s - p - q for t, s, p, q in zip(times["step"], times["schedule"], times["prepare (eager)"],
                                                            times["sample"])]
    result: dict[str, Any] = {phase: 1e3 * statistics.median(values) for phase, values in times.items()}
    return result | {"minivllm": str(Path(minivllm.__file__).parent)}


def git(*words: str) -> str:
    """What a git command prints in this repository."""
    return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def this_revision() -> str:
    """What this tree is, for the results: its commit, and whether the package measured differs
    from it ("not a git checkout" for a copy without history, which can measure but not compare)."""
    try:
        edited = git("status", "--porcelain", "--untracked-files=no", "--", "minivllm")
        return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if edited else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def worker(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """measure() in a fresh process that imports minivllm from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads))
    command = [sys.executable, __file__, "--worker", "--batch-size", str(args.batch_size), "--context",
               str(args.context), "--steps", str(args.steps), "--seed", str(args.seed), "--clock", args.clock]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"the measurement failed on {tree}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    imported = Path(result.pop("minivllm"))
    if imported != tree / "minivllm":  # an installed copy would shadow the tree under test
        raise SystemExit(f"the measurement of {tree} imported minivllm from {imported}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--context", type=int, default=600, help="tokens per request, within 10%%")
    parser.add_argument("--steps", type=int, default=40, help="decode steps measured per round; the median counts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each measuring every tree once")
    parser.add_argument("--baseline", default=None, help="a git revision to measure side by side with this tree")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter; cpu: the measuring thread's CPU time (a shared machine)")
    parser.add_argument("--results", default="09_host_step_cpu",
                        help="name of the JSON under benchmarks/results/ (chapter 16 writes 16_host_step_cpu)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("batch_size", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.context < 20:
        parser.error("--context must be at least 20")
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.batch_size, args.context, args.steps, args.seed, args.clock)))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console()
    trees = {"this tree": ROOT}
    revisions = {"this tree": this_revision()}
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline:
            revision = git("rev-parse", "--short", args.baseline)
            archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
            trees = {f"baseline {revision}": Path(scratch), "this tree": ROOT}
            revisions = {f"baseline {revision}": revision} | revisions
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):  # who goes first alternates
                runs[name].append(worker(trees[name], args))
                console.print(f"round {r + 1}/{args.rounds}, {name}: step {runs[name][-1]['step']:.2f} ms")
    medians = {name: {phase: statistics.median(run[phase] for run in rs) for phase in PHASES} for name, rs in runs.items()}
    import platform

    machine = (f"{platform.processor() or platform.machine()}, {args.threads} thread(s), load average "
               f"{os.getloadavg()[0]:.1f}, {args.clock} clock")
    table = Table(title=f"Host time of one decode step: {args.batch_size} requests, contexts ~{args.context}, "
                        f"median of {args.steps} steps × {args.rounds} rounds\n{machine}")
    table.add_column("phase")
    for name in trees:
        table.add_column(f"{name}\nms / step", justify="right")
        table.add_column(f"{name}\nµs / sequence", justify="right")
    if len(trees) == 2:
        table.add_column("ratio", justify="right")
    for phase in PHASES:
        cells = []
        for name in trees:
            cells += [f"{medians[name][phase]:.3f}", f"{1e3 * medians[name][phase] / args.batch_size:.2f}"]
        if len(trees) == 2:
            before, after = (medians[name][phase] for name in trees)
            cells.append(f"{before / after:.2f}×")
        table.add_row(phase, *cells)
    console.print(table)
    from minivllm.course.bench.harness import save_results

    path = save_results(args.results, dict(
        created=time.strftime("%Y-%m-%d %H:%M:%S"), machine=machine, python=platform.python_version(),
        batch_size=args.batch_size, context=args.context, steps=args.steps, rounds=args.rounds, clock=args.clock,
        command=" ".join(["python", "benchmarks/host_step.py", *sys.argv[1:]]), model=CONFIG,
        trees=revisions, runs=runs, medians_ms=medians))
    console.print(f"saved {path}")


if __name__ == "__main__":
    main()
