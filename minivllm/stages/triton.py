"""Chapter 8 — Triton paged attention: chapter 7's engine with attention="triton".

Nothing above attention changes: the same scheduler, block manager, model runner and sampler
as chapter 7, and the same KV pool and block tables. Only the attention object the runner
builds each step does: TritonPagedAttention (attention/triton_paged.py) stores K/V and reads
the pool in place with the kernels of attention/triton_kernels.py, instead of gathering each
sequence's blocks into a padded copy first.
"""
from __future__ import annotations

from typing import Any

from minivllm.entrypoints.llm import LLM
from minivllm.model import Decoder
from minivllm.stages import continuous
from minivllm.stages.common import StageStats


def engine_for(model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], **engine_options: Any) -> LLM:
    """continuous.engine_for with attention="triton"."""
    return continuous.engine_for(model, prompts, max_new_tokens, attention="triton", **engine_options)


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None,
    llm: LLM | None = None, **engine_options: Any,
) -> list[list[int]]:
    """Greedy continuations through the engine with Triton attention: `llm` (from engine_for),
    or one built from engine_options as continuous.generate does (block_size, num_kv_blocks, ...)."""
    llm = llm or engine_for(model, prompts, max_new_tokens, **engine_options)
    return continuous.generate(model, prompts, max_new_tokens, stats=stats, llm=llm)
