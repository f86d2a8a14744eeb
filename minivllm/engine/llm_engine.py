"""The online engine: add requests at any time, run one step at a time, stream what each
step produced, abort what is no longer wanted (chapter 7).

Each step is: scheduler.schedule() -> model_runner.run() -> sampler.sample() -> append the
new tokens, retire the finished requests. `LLM` (llm.py) is a loop around this for offline
batches; a server would call `step()` in its own loop and add requests as they arrive.
"""
from __future__ import annotations

import itertools
import random
import time
from typing import Any

import torch
from rich.console import Console

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.engine.sampler import SamplingParams, sample
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.trace import Trace
from minivllm.loader import load_model, load_tokenizer
from minivllm.model import Decoder

GPU_KV_FRACTION = 0.8  # of the GPU memory still free once the model is loaded
CPU_KV_BYTES = 256 * 2**20  # a fixed KV budget on CPU, where "free memory" means little
console = Console()


def kv_blocks_for_memory(model: Decoder, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """How many KV blocks the memory budget holds (never more than max_num_seqs full-length
    sequences could use)."""
    bytes_per_block = model.config.kv_bytes_per_token(model.dtype) * block_size
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = int(GPU_KV_FRACTION * free)
    else:
        budget = CPU_KV_BYTES
    useful = max_num_seqs * -(-max_model_len // block_size)
    return max(1, min(budget // bytes_per_block, useful))


class LLMEngine:
    def __init__(
        self, model: Any = None, device: str | None = None, dtype: torch.dtype | None = None, block_size: int = 16,
        num_kv_blocks: int | None = None, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
        max_model_len: int | None = None, attention: str = "torch", tokenizer: Any = None,
    ):
        """model: a minivllm Decoder, or any source load_model accepts (device and dtype are
        used only when loading). The tokenizer comes with the checkpoint when there is one."""
        if isinstance(model, Decoder):
            self.model = model
        else:
            self.model = load_model(model, device=device, dtype=dtype)
            tokenizer = tokenizer or load_tokenizer(model)
        self.tokenizer = tokenizer
        cfg = self.model.config
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if not 1 < self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {cfg.max_position_embeddings}] (the model's context), "
                             f"got {self.max_model_len}")
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_for_memory(self.model, block_size, max_num_seqs, self.max_model_len)
            mib = num_kv_blocks * block_size * cfg.kv_bytes_per_token(self.model.dtype) / 2**20
            console.print(f"[bold]KV cache[/] {num_kv_blocks:,} blocks × {block_size} tokens = "
                          f"{num_kv_blocks * block_size:,} tokens, {mib:,.0f} MiB on {self.model.device}")
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_batched_tokens, max_num_seqs)
        self.runner = ModelRunner(self.model, num_kv_blocks, block_size, attention)
        self.eos_token_ids = set(cfg.eos_token_ids)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.trace: Trace | None = None  # set to Trace() to record every step
        self._ids = itertools.count()
        self._seeds = random.Random()  # seeds for sampled requests that bring none

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request and return its id. Raises ValueError, touching nothing, if it
        cannot be served."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, self.max_model_len, prompt=text)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        needed = self.block_manager.blocks_for(seq.max_total_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"request {request_id!r} may need {needed} KV blocks, the pool only has "
                             f"{self.block_manager.num_blocks}: it could never run")
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            seq.generator = torch.Generator(self.model.device).manual_seed(seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids), refusing prompts that cannot be served."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not token_ids:
            raise ValueError("empty prompt: a request needs at least one token")
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        return text, token_ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown or finished ids are ignored)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output (tokens so far) for every request that got
        a new token, finished ones included."""
        start = time.perf_counter()
        schedule = self.scheduler.schedule()
        if not schedule.seqs:  # nothing queued
            return []
        record = self.trace.record(schedule, self.scheduler) if self.trace is not None else None
        rows, logits = self.runner.run(schedule)
        for seq, n in zip(schedule.seqs, schedule.num_new_tokens):
            seq.num_computed_tokens += n
        sampled = [schedule.seqs[i] for i in rows]
        tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
        now = time.perf_counter()
        outputs = []
        for seq, token in zip(sampled, tokens):
            seq.append_token(token, self.eos_token_ids, now)
            if seq.finish_reason is not None:
                seq.finish_time = now
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
            outputs.append(self._output(seq))
        if record is not None:
            record.seconds = now - start
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(0, seq.output_token_ids, seq.finish_reason, self.tokenizer)
        metrics = RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_preemptions)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished, metrics)
