"""The online engine: add requests at any time, run one step at a time, stream what each
step produced, abort what is no longer wanted (chapter 7), built from three pieces (chapter 15):

    add_request ──► InputProcessor ──► EngineCore ──► OutputProcessor ──► RequestOutputs
                    checks, tokens     schedule,      text, stop strings,
                                       run, sample    n completions, snapshots

`step()` runs one core step and hands its news to the output processor; a completion that a
stop string ended there is stopped in the core before the next step. `LLM` (llm.py) is a loop
around this for offline batches. The server runs the same three pieces with the core in a
process of its own (core_process/); here all three share the caller's thread, which is what
a laptop and the tests want: no second process to start, to feed, or to leave behind.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from minivllm.engine.config import EngineConfig
from minivllm.engine.core import STEP_PHASES, EngineCore
from minivllm.engine.input_processor import AUTO_ID_PREFIX, InputProcessor, Prompt
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.outputs import RequestOutput
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.trace import Trace
from minivllm.loader import load_model, load_tokenizer
from minivllm.model import Decoder

__all__ = ["AUTO_ID_PREFIX", "STEP_PHASES", "CorePart", "LLMEngine", "Prompt"]


class CorePart:
    """An attribute of the engine that is its core's: reading and setting it reach the core."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: LLMEngine | None, owner: type) -> Any:
        return self if engine is None else getattr(engine.core, self.name)

    def __set__(self, engine: LLMEngine, value: Any) -> None:
        setattr(engine.core, self.name, value)


class LLMEngine:
    def __init__(
        self, model: Any = None, device: str | None = None, dtype: torch.dtype | None = None, tokenizer: Any = None,
        config: EngineConfig | None = None, **settings: Any,
    ):
        """model: a minivllm Decoder, or any source load_model accepts (device and dtype are
        used only when loading). The tokenizer comes with the checkpoint when there is one.
        The engine's settings (block_size, num_kv_blocks, max_num_batched_tokens, max_num_seqs,
        max_model_len, attention, cuda_graphs, fused_ops, enable_prefix_caching, speculative_config,
        disable_any_whitespace, tensor_parallel_size, async_scheduling) come as keywords or as one
        EngineConfig, never both; see engine/config.py for what each one does."""
        if config is not None and settings:
            raise ValueError(f"pass the engine's settings as keywords or as config=EngineConfig(...), not both "
                             f"(got config and {', '.join(sorted(settings))})")
        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        config = config or EngineConfig.from_settings(**settings)  # checked before a model is loaded
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size} runs that many engine cores, each in a "
                             "process of its own, behind one router: use LLM(..., data_parallel_size=N) "
                             "or `minivllm serve --data-parallel-size N`; LLMEngine is one core in this process")
        if isinstance(model, Decoder):
            self.model = model
        elif config.tensor_parallel_size > 1:  # chapter 14: each rank reads its own shard; nobody loads the whole
            from minivllm.distributed.direct_load import unloaded_model

            self.model = unloaded_model(model, device=device, dtype=dtype)
            tokenizer = tokenizer or load_tokenizer(model)
        else:
            self.model = load_model(model, device=device, dtype=dtype)
            tokenizer = tokenizer or load_tokenizer(model)
        self.tokenizer = tokenizer
        self.config = config = config.resolve(self.model)
        self.input_processor = InputProcessor(tokenizer, self.model.config.vocab_size, config)
        self.core = EngineCore(self.model, config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)

    # The core's parts, for the chapters' pictures and the tests that look inside a step (or
    # swap a part: a runner with graphs, a timed scheduler). trace: set to Trace() to record every step.
    scheduler = CorePart()
    block_manager = CorePart()
    runner = CorePart()
    sampler = CorePart()
    speculator = CorePart()
    grammars = CorePart()
    eos_token_ids = CorePart()
    requests = CorePart()
    trace: Trace | None = CorePart()
    overlap = CorePart()  # chapter 16: the core's AsyncScheduler, or None (synchronous steps)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def get_tokenizer(self) -> Any:
        """The tokenizer (None when the checkpoint has none)."""
        return self.tokenizer

    def add_request(
        self, request_id: str | None = None, prompt: Prompt | None = None, params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request and return its id (vLLM's argument order; keywords work too).
        prompt: text, a list of token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
        request_id: any string not starting with "auto-", which marks the ids the engine chooses
        itself when given None (so the two can never collide). Raises ValueError, touching
        nothing, if it cannot be served."""
        if prompt is None:
            raise ValueError("add_request needs a prompt: add_request(request_id=..., prompt=..., params=...)")
        text, request = self.input_processor.process(request_id, prompt, params, arrival_time)
        self.core.add_request(request)
        self.output_processor.add_request(request, text)
        return request.request_id

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids), refusing with ValueError the prompts that cannot be
        served (InputProcessor.tokenize: any thread may call it)."""
        return self.input_processor.tokenize(prompt)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or several) now, all n of its completions, and free their blocks.
        Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.core.abort_requests(ids)
        for rid in ids:
            self.output_processor.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that got a new token,
        finished ones included (FINAL_ONLY requests: only when they finish)."""
        outputs, stopped = self.output_processor.process_outputs(self.core.step())
        self.core.abort_sequences(stopped)  # stop strings end completions in the core too
        return outputs
