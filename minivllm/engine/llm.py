"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

Under the hood it is the online engine in a loop: queue every prompt, step until nothing is
left, return the finished outputs in the order the prompts came in.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.outputs import RequestOutput
from minivllm.engine.sampler import SamplingParams
from minivllm.engine.trace import Trace

Prompt = str | list[int]


class LLM:
    """An engine for offline batches. Arguments as LLMEngine's; `model` may be a loaded
    minivllm Decoder or anything load_model accepts (None: the embedded default model)."""

    def __init__(
        self, model: Any = None, device: str | None = None, dtype: torch.dtype | None = None, block_size: int = 16,
        num_kv_blocks: int | None = None, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
        max_model_len: int | None = None, attention: str = "torch", tokenizer: Any = None,
    ):
        self.engine = LLMEngine(model, device, dtype, block_size, num_kv_blocks, max_num_batched_tokens,
                                max_num_seqs, max_model_len, attention, tokenizer)

    @property
    def trace(self) -> Trace | None:
        return self.engine.trace

    @trace.setter
    def trace(self, trace: Trace | None) -> None:
        self.engine.trace = trace

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (strings or token-id lists); one SamplingParams for all, or one
        per prompt. Returns one finished RequestOutput per prompt, in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        ids = self._add_all(prompts, sampling_params)
        finished: dict[str, RequestOutput] = {}
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not use_tqdm, transient=True) as progress:
            task = progress.add_task("", total=len(ids))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        progress.advance(task)
        return [finished[i] for i in ids]

    def _add_all(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams]) -> list[str]:
        """Queue every prompt, or none: if one is refused, the ones already queued are taken
        back before the error goes up, so the engine is left as it was."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError as err:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise ValueError(f"prompt {len(ids)}: {err}") from err
        return ids
