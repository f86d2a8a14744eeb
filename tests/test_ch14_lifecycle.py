"""Chapter 14: the processes of a tensor-parallel engine. None outlives its engine or its program
(deleted, exited, interrupted with Ctrl-C, killed outright); a worker that dies turns the next
call into a RuntimeError that names it, between steps or in the middle of one, instead of a
hang; and the same workers under torchrun, as two "nodes" on 127.0.0.1, give transformers'
tokens. Every wait is bounded."""
from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from test_ch14_tensor_parallel import GREEDY, gone, running, tensor_parallel
from tiny_models import random_prompts

from minivllm import LLM, SamplingParams
from minivllm.executor.group import free_port

pytestmark = [pytest.mark.ch14, pytest.mark.floors]

ROOT = Path(__file__).parents[1]
RAISE_SECONDS = 15  # a dead worker becomes an error within this
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_deleting_the_engine_stops_its_workers(qwen3_model):
    assert not dist.is_initialized()
    llm = LLM(qwen3_model, tensor_parallel_size=2, num_kv_blocks=16)
    pids = llm.engine.core.runner.pids
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    del llm
    gc.collect()
    assert gone(pids), f"workers {pids} outlived their engine"
    assert not dist.is_initialized(), "the engine left its process group behind"


def test_a_worker_that_dies_between_steps_makes_the_next_call_fail(qwen3_model):
    with tensor_parallel(LLM, qwen3_model, tensor_parallel_size=2, num_kv_blocks=16) as llm:
        pid = llm.engine.core.runner.pids[0]
        params = SamplingParams(max_tokens=3, **GREEDY)
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
        os.kill(pid, signal.SIGKILL)
        assert gone([pid])
        for attempt in range(2):  # and every call after it
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=rf"worker 1 \(pid {pid}\) was killed by SIGKILL"):
                llm.generate([[4, 5, 6]], params, use_tqdm=False)
            assert time.monotonic() - start < RAISE_SECONDS, f"attempt {attempt}"


def test_a_worker_that_dies_inside_a_step_makes_it_fail(qwen3_model):
    """Killed after the step's message went out, while rank 0 is in the step's collectives."""
    with tensor_parallel(LLM, qwen3_model, tensor_parallel_size=2, num_kv_blocks=16) as llm:
        runner = llm.engine.core.runner
        pid, send, sent = runner.pids[0], runner.group.channel.send, []

        def send_then_kill(plan):
            send(plan)
            sent.append(plan)
            if len(sent) == 3:
                os.kill(pid, signal.SIGKILL)

        runner.group.channel.send = send_then_kill
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker 1 \(pid {pid}\) was killed by SIGKILL during a step"):
            llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)
        assert time.monotonic() - start < RAISE_SECONDS
        assert len(sent) == 3


PROGRAM = """
import sys, time, torch
from minivllm import LLM, SamplingParams
from minivllm.config import engine as config

config.PERSISTENT_BATCH_DEFAULT = False  # the runner as chapter 14 built it (tests/conftest.py, LATER_DEFAULTS)

if __name__ == "__main__":
    torch.set_num_threads(1)
    llm = LLM(None, device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    print("PIDS", *llm.engine.core.runner.pids, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
    while True:  # busy: a signal lands in the middle of some step
        llm.generate(["def f(x):"] * 4, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
        print("GENERATED", flush=True)
"""


def lines_of(process: subprocess.Popen) -> queue.Queue:
    """The process's stdout lines, read on a thread, so that waiting for one can be bounded;
    None when its output ends."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def next_line(lines: queue.Queue, prefix: str, errors: Path, timeout: float = 240) -> str:
    """The program's next stdout line that starts with `prefix`; a failure that quotes the end
    of its stderr (file `errors`) if it ends or takes longer than `timeout` first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            pytest.fail(f"the program ended before printing a {prefix!r} line:\n{errors.read_text()[-2000:]}")
        if line.startswith(prefix):
            return line
    pytest.fail(f"the program printed no {prefix!r} line within {timeout} s:\n{errors.read_text()[-2000:]}")


@pytest.mark.parametrize("ending", ["exit", "ctrl-c", "sigkill"])
def test_no_worker_outlives_its_program(tmp_path, ending):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    # Its own process group, as a terminal gives a program: Ctrl-C signals the whole group, workers included.
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as stderr:
        program = subprocess.Popen([sys.executable, str(script), "exit" if ending == "exit" else "generate"], env=ENV,
                                   stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    try:
        lines = lines_of(program)
        pids = [int(p) for p in next_line(lines, "PIDS", errors).split()[1:]]
        assert pids and all(running(pid) for pid in pids)
        if ending == "ctrl-c":
            next_line(lines, "GENERATED", errors)  # the engine is busy: Ctrl-C finds it inside a step or close to one
            os.killpg(program.pid, signal.SIGINT)
        elif ending == "sigkill":
            next_line(lines, "GENERATED", errors)
            program.kill()  # no atexit, no finalizer: the workers must notice by themselves
        program.wait(timeout=120)
        assert gone(pids), f"{ending}: workers {pids} outlived their program"
    finally:
        program.kill()
        program.wait(timeout=30)


WORKER_PROGRAM = """
import json, sys, torch
from minivllm import LLM, SamplingParams
from minivllm.config import engine as config

config.PERSISTENT_BATCH_DEFAULT = False  # the runner as chapter 14 built it (tests/conftest.py, LATER_DEFAULTS)
torch.set_num_threads(1)
llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, block_size=4, num_kv_blocks=32)  # rank 1: serves, exits
prompts = json.loads(sys.argv[2])
outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
"""


def test_the_same_workers_under_torchrun_as_two_nodes(tmp_path, tiny_checkpoint, hf_models, reference):
    """torchrun on "node" 0 and "node" 1 of 127.0.0.1: one process each, env:// rendezvous."""
    script = tmp_path / "two_nodes.py"
    script.write_text(textwrap.dedent(WORKER_PROGRAM))
    prompts = random_prompts([5, 9], seed=11)
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
         "1", "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(tiny_checkpoint),
         json.dumps(prompts)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        results = [node.communicate(timeout=280) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for rank, (node, (out, err)) in enumerate(zip(nodes, results)):
        assert node.returncode == 0, f"node {rank} failed:\n{err[-3000:]}"
    tokens = json.loads(next(line for line in results[0][0].splitlines() if line.startswith("TOKENS"))[len("TOKENS"):])
    assert tokens == [reference(hf_models["qwen3"], p, 8) for p in prompts]
    assert "TOKENS" not in results[1][0], "rank 1 served as a worker: the program's rest runs on rank 0 only"
