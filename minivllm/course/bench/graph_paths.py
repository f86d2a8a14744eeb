"""Which graphs each step of a run replays (chapter 9): ModelRunner.graphs_for, step by step.

The engine's runner is swapped for one with decode graphs and piecewise graphs (on a CPU their
stand-ins, EagerGraph and EagerPieces: the rule and the buckets are the same as on a GPU), a
workload runs through it, and every step's token count and path are recorded, with the tokens
checked against the eager engine's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from minivllm.course.bench.workloads import make_workload
from minivllm.entrypoints.llm import LLM
from minivllm.model import Decoder
from minivllm.request.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunner


def graph_paths(model: Decoder, workload: str = "classroom", num_requests: int = 16, max_num_seqs: int = 8,
                max_num_batched_tokens: int = 256, seed: int = 0) -> dict[str, Any]:
    """Run `workload` (greedy, EOS ignored) on an engine whose runner replays decode graphs and
    pieces. Returns the steps ({"tokens", "path"} each: "decode graph", "pieces" or "eager"),
    the piece buckets, and whether the tokens equal the eager engine's."""
    work = make_workload(workload, model.config.vocab_size, seed=seed, num_requests=num_requests)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    settings = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    enable_prefix_caching=False)
    eager = [o.outputs[0].token_ids for o in LLM(model, **settings).generate(work.prompts, params, use_tqdm=False)]
    llm = LLM(model, **settings)
    engine = llm.engine
    config = dataclasses.replace(engine.config, cuda_graphs=True, piecewise_graphs=True)
    runner = engine.core.runner = ModelRunner(engine.model, config)
    steps: list[dict[str, Any]] = []
    choose = runner.graphs_for

    def recorded(num_new_tokens: list[int]) -> tuple[bool, int | None]:
        decode, bucket = choose(num_new_tokens)
        path = "decode graph" if decode else "pieces" if bucket is not None else "eager"
        steps.append(dict(tokens=sum(num_new_tokens), sequences=len(num_new_tokens), path=path, bucket=bucket))
        return decode, bucket

    runner.graphs_for = recorded
    got = [o.outputs[0].token_ids for o in llm.generate(work.prompts, params, use_tqdm=False)]
    return dict(workload=work.describe(), max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                piece_sizes=runner.pieces.sizes, steps=steps, same_tokens_as_eager=got == eager)
