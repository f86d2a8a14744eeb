"""The online engine: add requests at any time, run one step at a time, stream what each
step produced, abort what is no longer wanted (chapter 7), built from three pieces (chapter 15):

    add_request ──► InputProcessor ──► core client ──► EngineCore ──► OutputProcessor ──► RequestOutputs
                    checks, tokens     (core_client.py)  schedule,     text, stop strings,
                                                         run, sample   n completions, snapshots

`step()` takes the core's next step and hands its news to the output processor; a completion
that a stop string ended there is stopped in the core before its next step. `LLM`
(entrypoints/llm.py) is a loop around this for offline batches. Where the core runs is the
client's business (make_client): in this thread by default, which is what a laptop and the tests
want (no second process to start, to feed, or to leave behind); in a process of its own with
multiprocess=True (chapter 15); N copies with data_parallel_size=N (chapter 14).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from minivllm.config.engine import EngineConfig
from minivllm.core.engine_core import STEP_PHASES, EngineCore
from minivllm.engine.core_client import InprocClient, make_client, refusal_error
from minivllm.engine.input_processor import AUTO_ID_PREFIX, InputProcessor, Prompt
from minivllm.engine.output_processor import OutputProcessor, RequestState
from minivllm.engine.process_client import CoreDied
from minivllm.model import Decoder
from minivllm.request.messages import Failed, Refused, StepOutputs
from minivllm.request.outputs import RequestOutput
from minivllm.request.sampling_params import SamplingParams

__all__ = ["AUTO_ID_PREFIX", "STEP_PHASES", "LLMEngine", "Prompt"]


class LLMEngine:
    def __init__(
        self, model: Any = None, device: str | None = None, dtype: torch.dtype | None = None, tokenizer: Any = None,
        config: EngineConfig | None = None, multiprocess: bool = False, **settings: Any,
    ):
        """model: a minivllm Decoder, or any source load_model accepts (device and dtype are
        used only when loading). The tokenizer comes with the checkpoint when there is one.
        The engine's settings (block_size, num_kv_blocks, max_num_batched_tokens, max_num_seqs,
        max_model_len, attention, cuda_graphs, fused_ops, enable_prefix_caching, speculative_config,
        disable_any_whitespace, tensor_parallel_size, data_parallel_size, async_scheduling,
        persistent_batch) come as keywords or as one EngineConfig, never both; see config/engine.py
        for what each one does. multiprocess: the core in a process of its own (chapter 15);
        data_parallel_size=N always runs N core processes. Call shutdown() when a core runs in
        another process (it is also called when the engine is collected)."""
        if config is not None and settings:
            raise ValueError(f"pass the engine's settings as keywords or as config=EngineConfig(...), not both "
                             f"(got config and {', '.join(sorted(settings))})")
        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        if not isinstance(multiprocess, bool):
            raise ValueError(f"multiprocess must be True or False, got {multiprocess!r}")
        config = config or EngineConfig.from_settings(**settings)  # checked before a model is loaded
        self.client, self.tokenizer = make_client(model, config, tokenizer, device, dtype, multiprocess=multiprocess)
        self.config: EngineConfig = self.client.config  # resolved for the model
        self.input_processor = InputProcessor(self.tokenizer, self.client.info["vocab_size"], self.config)
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def core(self) -> EngineCore:
        """The engine core, when it runs in this thread: its scheduler, block manager, runner and
        sampler are what the chapters draw and the tests look into (set core.trace = Trace() to
        record every step)."""
        if not isinstance(self.client, InprocClient):
            raise RuntimeError("the engine core runs in another process: its parts cannot be reached from here "
                               "(an engine with data_parallel_size=1 and multiprocess=False has its core in this thread)")
        return self.client.core

    @property
    def model(self) -> Decoder:
        """The model, when the core runs in this thread."""
        return self.core.model

    @property
    def requests(self) -> dict[str, RequestState]:
        """The requests not yet finished, by id."""
        return self.output_processor.requests

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
        nothing, if it cannot be served (a core in another process refuses at its next step()
        instead)."""
        if prompt is None:
            raise ValueError("add_request needs a prompt: add_request(request_id=..., prompt=..., params=...)")
        text, request = self.input_processor.process(request_id, prompt, params, arrival_time)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.client.add_request(request)
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
        ids = [rid for rid in ids if rid in self.requests]
        for rid in ids:
            self.output_processor.abort_request(rid)
        if ids:
            self.client.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that got a new token,
        finished ones included (FINAL_ONLY requests: only when they finish). With a core in
        another process: its next step, ValueError for a request it refused (forgotten here),
        RuntimeError if a core failed or died."""
        if isinstance(self.client, InprocClient):
            message = self.client.get_output()
        elif not self.has_unfinished_requests():
            return []
        else:
            try:
                message = self.client.get_output()
            except CoreDied as err:
                raise RuntimeError(f"an engine core died: {err}") from err
        if isinstance(message, Refused):
            self.output_processor.abort_request(message.request_id)
        if isinstance(message, Refused | Failed):
            raise refusal_error(message)
        if not isinstance(message, StepOutputs):
            return []
        outputs, stopped = self.output_processor.process_outputs(message.outputs)
        if stopped:
            self.client.stop_sequences(stopped)  # stop strings end completions in the core too
        return outputs

    def shutdown(self) -> None:
        """Stop the core's processes, if it has any (nothing to do for a core in this thread).
        The engine cannot step afterwards."""
        self.client.shutdown()
