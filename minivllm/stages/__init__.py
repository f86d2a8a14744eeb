"""The ladder of the course: one `generate(model, prompts, max_new_tokens, **options)` per
chapter, in order. Every stage is greedy, takes prompts as token-id lists, and returns each
prompt's new token ids in input order; they differ only in how attention sees the past."""
from __future__ import annotations

from collections.abc import Callable

from minivllm.stages import kv_cache, naive

Generate = Callable[..., list[list[int]]]

STAGES: dict[str, Generate] = {
    "naive": naive.generate,
    "kv_cache": kv_cache.generate,
}
