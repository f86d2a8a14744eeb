"""Chapter 7 — continuous batching: the finished engine, used as a stage of the ladder.

Chapter 6 still ran requests in groups: a newcomer waited until the whole group was done,
and a request that finished early left its seat empty. Here the scheduler decides every
step (core/scheduler.py): finished requests leave at once, waiting ones join at once with
as much of their prompt as the token budget allows, and when KV blocks run out the newest
request is preempted and recomputed later. The stage is a thin wrapper: greedy, ignore EOS,
through `LLM`, exactly as a user would call it.
"""
from __future__ import annotations

from typing import Any

from minivllm.core.trace import Trace
from minivllm.entrypoints.llm import LLM
from minivllm.model import Decoder
from minivllm.request.sampling_params import SamplingParams
from minivllm.stages.common import StageStats, prepare


def engine_for(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], attention: str = "torch",
    **engine_options: Any,
) -> LLM:
    """The engine `generate` runs these requests on. engine_options go to LLM (block_size,
    num_kv_blocks, max_num_batched_tokens, max_num_seqs, ...); attention picks "torch" or
    "triton" paged attention. Chapter 9's CUDA graphs and fused ops and chapter 11's prefix
    caching stay off unless asked for: this stage is chapters 7 and 8's engine on every device.

    Building it allocates the KV pool and, with cuda_graphs, captures the graphs: a benchmark
    builds it once, outside its timer, and passes it to generate(llm=...) for the warm-up and
    the timed run alike (the requests of both must fit what it was sized for)."""
    lengths = prepare(model, prompts, max_new_tokens)
    sizes = [len(p) + n for p, n in zip(prompts, lengths) if n > 0] or [2]
    # Like chapter 6's stage, size the pool to hold the whole workload unless told otherwise:
    # the engine's default budget (256 MiB on CPU) would be zero-filled on every call.
    # The longest request bounds the context: a CUDA graph (chapter 9) sizes attention for it.
    engine_options.setdefault("max_model_len", max(2, max(sizes)))
    engine_options.setdefault("cuda_graphs", False)
    engine_options.setdefault("fused_ops", False)
    engine_options.setdefault("enable_prefix_caching", False)
    block_size = engine_options.setdefault("block_size", 16)
    engine_options.setdefault("num_kv_blocks", sum(-(-n // block_size) for n in sizes))
    return LLM(model, attention=attention, **engine_options)


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None,
    llm: LLM | None = None, **engine_options: Any,
) -> list[list[int]]:
    """Greedy continuations through the engine: `llm`, one engine_for built, or a new one built
    from engine_options as engine_for does (an engine comes with its settings: not both)."""
    lengths = prepare(model, prompts, max_new_tokens)
    todo = [i for i, n in enumerate(lengths) if n > 0]  # a request for 0 tokens needs no engine
    outputs: list[list[int]] = [[] for _ in prompts]
    if not todo:
        return outputs
    if llm is None:
        llm = engine_for(model, [prompts[i] for i in todo], [lengths[i] for i in todo], **engine_options)
    elif engine_options:
        raise ValueError(f"an engine given as llm= comes with its settings; got {sorted(engine_options)} as well")
    llm.trace = Trace() if stats is not None else None
    params = [SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True) for i in todo]
    results = llm.generate([prompts[i] for i in todo], params, use_tqdm=False)
    for i, result in zip(todo, results):
        outputs[i] = result.outputs[0].token_ids
    if stats is not None:
        for step in llm.trace.steps:
            stats.token_slots += step.num_tokens
            stats.wasted_slots += step.recomputed  # work thrown away by preemptions, done again
            stats.record_kv(used=step.kv_tokens, reserved=step.kv_reserved_tokens)
    return outputs
