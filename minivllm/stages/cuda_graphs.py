"""Chapter 9 — the host is the bottleneck: the engine with everything that keeps the GPU busy.

Chapters 7 and 8 run the engine eagerly: every step, Python walks the layers and launches
each small kernel one by one while the GPU waits. This stage is the same engine with
chapter 9's switches on where they can be: decode steps replayed from CUDA graphs, the
token-wise work as fused Triton kernels, Triton attention. Its batch preparation is the lean
one (worker/prepare.py), like every engine stage since chapter 9.

On a CPU there are no CUDA graphs and Triton runs only in its (slow) interpreter, so there
this stage is chapter 7's engine with the lean step: the lesson of chapter 9 is a GPU's.
"""
from __future__ import annotations

from typing import Any

from minivllm.entrypoints.llm import LLM
from minivllm.model import Decoder
from minivllm.stages import continuous
from minivllm.stages.common import StageStats


def engine_for(model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], **engine_options: Any) -> LLM:
    """continuous.engine_for with the engine's automatic settings (graphs, fused ops and Triton
    attention on a GPU). On a GPU, building it captures the graphs: build it outside a timer."""
    on_gpu = model.device.type == "cuda"
    engine_options = dict(attention="triton" if on_gpu else "torch", cuda_graphs=None, fused_ops=None) | engine_options
    return continuous.engine_for(model, prompts, max_new_tokens, **engine_options)


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None,
    llm: LLM | None = None, **engine_options: Any,
) -> list[list[int]]:
    """Greedy continuations through `llm` (from engine_for) or one built from engine_options."""
    llm = llm or engine_for(model, prompts, max_new_tokens, **engine_options)
    return continuous.generate(model, prompts, max_new_tokens, stats=stats, llm=llm)
