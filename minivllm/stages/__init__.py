"""The ladder of the course: one `generate(model, prompts, max_new_tokens, **options)` per
chapter, in order. Every stage is greedy, takes prompts as token-id lists, and returns each
prompt's new token ids in input order; they differ only in how attention sees the past."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minivllm.stages import (
                             chunked_prefill,
                             continuous,
                             cuda_graphs,
                             kv_cache,
                             naive,
                             paged,
                             ragged_batch,
                             static_batch,
                             triton,
)

Generate = Callable[..., list[list[int]]]

STAGES: dict[str, Generate] = {
    "naive": naive.generate,
    "kv_cache": kv_cache.generate,
    "static_batch": static_batch.generate,
    "ragged_batch": ragged_batch.generate,
    "chunked_prefill": chunked_prefill.generate,
    "paged": paged.generate,
    "continuous": continuous.generate,
    "triton": triton.generate,
    "cuda_graphs": cuda_graphs.generate,
}

# The stages that run on the engine, and how each builds it: engine_for(model, prompts,
# max_new_tokens, **options) -> LLM, for generate(..., llm=...). Building an engine (its KV pool,
# its CUDA graphs) is set-up, not generation: benchmarks build it before their timer starts.
ENGINES: dict[str, Callable[..., Any]] = {
    "continuous": continuous.engine_for,
    "triton": triton.engine_for,
    "cuda_graphs": cuda_graphs.engine_for,
}
