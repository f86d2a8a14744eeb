"""Chapter 14 — what tensor parallelism costs on this machine: each step split into compute and
communication, for several tensor-parallel sizes, side by side in one run.

For each size N a fresh engine of N ranks (N processes; rank 0 is this one) runs the same
requests, after a warm-up. The engine's trace times every step; rank 0's Communicator adds up
the time its collectives took. On a CPU (gloo) a collective returns only when it is done, so
that is the time communication cost rank 0, waiting for the slowest rank included; the rest of
the step is compute (and the host's own work). Every size must produce the same tokens.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from typing import Any

import torch

from minivllm.core.trace import Trace
from minivllm.course.bench.workloads import Workload
from minivllm.course.text import random_prompts
from minivllm.distributed.layers import CommStats
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.machine import synchronize
from minivllm.model import Decoder
from minivllm.request.sampling_params import SamplingParams


def fixed_workload(vocab_size: int, requests: int, prompt_len: int, output_len: int, seed: int = 0) -> Workload:
    """`requests` random prompts of prompt_len tokens, each asking for output_len tokens: after
    the first steps, every step decodes a batch of `requests` sequences."""
    return Workload(f"{requests} requests x ({prompt_len} prompt + {output_len} output tokens)",
                    random_prompts([prompt_len] * requests, vocab_size, seed), [output_len] * requests)


def comm_stats(engine: LLMEngine) -> CommStats:
    """Rank 0's tally of its collectives so far (zero for an engine of one rank)."""
    group = getattr(engine.core.runner, "group", None)
    stats = group.comm.stats if group is not None else CommStats()
    return CommStats(stats.calls, stats.bytes, stats.seconds)


def run_size(model: Decoder, size: int, work: Workload, settings: dict[str, Any], repeats: int = 1) -> dict[str, Any]:
    """The workload on a fresh engine of `size` ranks: tokens/s, and per step its time, its
    communication and its collectives' calls and bytes (medians over `repeats` runs, after a
    warm-up on two requests)."""
    llm = LLM(model, tensor_parallel_size=size, **settings)
    try:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
        llm.generate(work.prompts[:2], params[:2], use_tqdm=False)  # warm-up
        runs = []
        for _ in range(repeats):
            llm.trace = Trace()
            before = comm_stats(llm.engine)
            synchronize(model.device)
            start = time.perf_counter()
            outs = llm.generate(work.prompts, params, use_tqdm=False)
            synchronize(model.device)
            seconds = time.perf_counter() - start
            after = comm_stats(llm.engine)
            steps = llm.trace.steps
            tokens = [o.outputs[0].token_ids for o in outs]
            runs.append(dict(
                seconds=seconds, tokens_per_second=sum(map(len, tokens)) / seconds, steps=len(steps),
                step_seconds=sum(s.seconds for s in steps) / len(steps),
                comm_seconds=(after.seconds - before.seconds) / len(steps),
                comm_calls=(after.calls - before.calls) / len(steps), comm_bytes=(after.bytes - before.bytes) / len(steps),
                comm_bytes_total=after.bytes - before.bytes, tokens_computed=sum(s.num_tokens for s in steps),
                decode_steps=sum(1 for s in steps if not s.prefill),
                outputs_digest=hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]))
    finally:
        if size > 1:
            llm.engine.core.runner.shutdown()
    row = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "tokens_per_second", "step_seconds",
                                                              "comm_seconds")}
    first = runs[0]
    row |= {k: first[k] for k in ("steps", "decode_steps", "comm_calls", "comm_bytes", "comm_bytes_total",
                                  "tokens_computed", "outputs_digest")}
    row["compute_seconds"] = row["step_seconds"] - row["comm_seconds"]
    return dict(size=size, threads_per_rank=torch.get_num_threads(), runs=runs, **row)


def compare_sizes(model: Decoder, sizes: list[int], work: Workload, settings: dict[str, Any],
                  repeats: int = 1) -> dict[str, Any]:
    """run_size for every size, in order, and whether they all produced the same tokens."""
    rows = [run_size(model, n, work, settings, repeats) for n in sizes]
    return dict(workload=work.name, requests=len(work.prompts), prompt_lens=[len(p) for p in work.prompts],
                output_lens=work.output_lens, settings=settings, repeats=repeats, sizes=rows,
                same_tokens=len({r["outputs_digest"] for r in rows}) == 1)


def _find(full: torch.Tensor, part: torch.Tensor, dim: int) -> list[int]:
    """[start, end) of the slice of `full` along `dim` that equals `part` (stepping by its width)."""
    width = part.shape[dim]
    for start in range(0, full.shape[dim] - width + 1, width):
        if torch.equal(full.narrow(dim, start, width), part):
            return [start, start + width]
    raise ValueError(f"no slice of width {width} along dim {dim} equals the shard")


LAYER_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _matrix(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """A decoder layer's weight `name` (a row-parallel shard's own weight, in a shard)."""
    module = getattr(layer.self_attn if name in LAYER_MATRICES[:4] else layer.mlp, name)
    return getattr(module, "shard", module).weight


def shard_layout(model: Decoder, world_size: int, layer: int = 0) -> list[dict[str, Any]]:
    """Where each rank's weights of one decoder layer sit in the full matrices, found by matching
    every rank's real shard (shard_decoder) against the model: per matrix its name, in and out
    features, how it is split ("column": output features, "row": input features) and each
    rank's [start, end) along that axis. Builds every rank's whole shard: memory for N models."""
    from minivllm.distributed.layers import Communicator
    from minivllm.distributed.shard import shard_decoder

    full = model.layers[layer]
    layout = []
    for name in LAYER_MATRICES:
        out_features, in_features = _matrix(full, name).shape
        layout.append(dict(name=name, kind="row" if name in ROW_PARALLEL else "column", out_features=out_features,
                           in_features=in_features, ranks=[]))
    for rank in range(world_size):
        shard = shard_decoder(model, Communicator(rank, world_size)).layers[layer]  # no collective runs here
        for entry in layout:
            dim = 1 if entry["kind"] == "row" else 0  # PyTorch's weight is [out, in]
            entry["ranks"].append(_find(_matrix(full, entry["name"]), _matrix(shard, entry["name"]), dim))
        del shard
    return layout
