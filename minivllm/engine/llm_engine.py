"""The online engine: add requests at any time, run one step at a time, stream what each
step produced, abort what is no longer wanted (chapter 7).

Each step is: scheduler.schedule() -> model_runner.run() -> sampler() -> append the new
tokens (and, for requests that need text now, detokenize and look for stop strings), retire
the finished requests. `LLM` (llm.py) is a loop around this for offline batches; a server
would call `step()` in its own loop and add requests as they arrive.

A request for n completions (chapter 10) is a SequenceGroup of n sequences that the scheduler
runs independently; the engine answers with one RequestOutput holding all n.

A request with structured_outputs (chapter 13) has its constraint checked in add_request and
compiled in the background (structured_outputs/); each of its sequences gets a matcher, which
the sampler asks for a mask and the step advances with the sampled token. A grammar that has
ended ends its request ("stop"), even with ignore_eos.
"""
from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Iterable
from concurrent import futures
from typing import Any

import torch
from torch.profiler import record_function

from minivllm.engine.async_scheduling import AsyncScheduler, SampledTokens, StepInFlight
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.config import EngineConfig
from minivllm.engine.detokenizer import StopChecker
from minivllm.engine.logprobs import TopLogprobs, top_logprobs, unpack_logprobs
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minivllm.engine.prefix_cache import PrefixCachingBlockManager
from minivllm.engine.sampler import Sampler
from minivllm.engine.sampling_params import RequestOutputKind, SamplingParams
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceGroup
from minivllm.engine.spec_decode.speculator import Speculator
from minivllm.engine.structured_outputs.backend import XgrammarBackend
from minivllm.engine.structured_outputs.matcher import SequenceGrammar
from minivllm.engine.trace import Trace
from minivllm.loader import load_model, load_tokenizer
from minivllm.model import Decoder

# The parts of a step, as named ranges in a torch.profiler trace (see minivllm/bench/profiling.py):
# planning, turning the plan into tensors, the model, choosing tokens, bookkeeping.
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "finish")
AUTO_ID_PREFIX = "auto-"  # request ids the engine chooses; callers may not use it
GRAMMAR_WAIT = 0.05  # seconds a step with nothing to run waits for a grammar to compile (then it returns)
Prompt = str | list[int] | dict[str, Any]  # text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}


class LLMEngine:
    def __init__(
        self, model: Any = None, device: str | None = None, dtype: torch.dtype | None = None, tokenizer: Any = None,
        config: EngineConfig | None = None, **settings: Any,
    ):
        """model: a minivllm Decoder, or any source load_model accepts (device and dtype are
        used only when loading). The tokenizer comes with the checkpoint when there is one.
        The engine's settings (block_size, num_kv_blocks, max_num_batched_tokens, max_num_seqs,
        max_model_len, attention, cuda_graphs, fused_ops, enable_prefix_caching, speculative_config,
        disable_any_whitespace, tensor_parallel_size) come as keywords or as one EngineConfig, never
        both; see engine/config.py for what each one does."""
        if config is not None and settings:
            raise ValueError(f"pass the engine's settings as keywords or as config=EngineConfig(...), not both "
                             f"(got config and {', '.join(sorted(settings))})")
        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        config = config or EngineConfig.from_settings(**settings)  # checked before a model is loaded
        if isinstance(model, Decoder):
            self.model = model
        else:
            self.model = load_model(model, device=device, dtype=dtype)
            tokenizer = tokenizer or load_tokenizer(model)
        self.tokenizer = tokenizer
        self.config = config = config.resolve(self.model)
        manager = PrefixCachingBlockManager if config.enable_prefix_caching else BlockManager
        self.block_manager = manager(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        if config.tensor_parallel_size > 1:  # chapter 14: rank 0's runner, which also drives the other ranks
            from minivllm.distributed.executor import TensorParallelRunner

            self.runner = TensorParallelRunner(self.model, config)
        else:
            self.runner = ModelRunner(self.model, config)
        self.sampler = Sampler()  # chooses the tokens; keeps penalised requests' token counts between steps
        self.speculator = (Speculator(config.speculative_config, self.model, config, self.sampler)
                           if config.speculative_config is not None else None)  # chapter 12
        self.grammars: XgrammarBackend | None = None  # chapter 13: made at the first request with a constraint
        self.eos_token_ids = set(self.model.config.eos_token_ids)
        self.requests: dict[str, SequenceGroup] = {}  # unfinished requests by id (n completions each)
        self.trace: Trace | None = None  # set to Trace() to record every step
        # Chapter 16: step N+1 planned and launched while step N runs; not with speculation (its
        # proposals read the newest tokens).
        self.overlap = AsyncScheduler(self) if config.async_scheduling and self.speculator is None else None
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def get_tokenizer(self) -> Any:
        """The tokenizer (None when the checkpoint has none)."""
        return self.tokenizer

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request and return its id. prompt: text, a list of token ids, or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids}. request_id: any string not starting with
        "auto-", which marks the ids the engine chooses itself when given None (so the two can
        never collide). Raises ValueError, touching nothing, if it cannot be served."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"{AUTO_ID_PREFIX}{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id or request_id.startswith(AUTO_ID_PREFIX):
            raise ValueError(f"request_id must be a non-empty string not starting with {AUTO_ID_PREFIX!r} (those are "
                             f"the engine's own), got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        self._check_params(params)
        compiled = self._compile_constraint(params)  # chapter 13: None without structured_outputs
        group = SequenceGroup(request_id, text, token_ids, params,
                              prompt_logprobs=None if params.prompt_logprobs is None else [None])
        for i in range(params.n):
            name = request_id if params.n == 1 else f"{request_id}#{i}"
            seq = Sequence(name, token_ids, params, self.max_model_len, prompt=text, index=i, group=group)
            if arrival_time is not None:
                seq.arrival_time = arrival_time
            if not params.greedy and params.seed is not None:  # completion i of a seeded request uses seed + i
                # A generator of its own: its tokens do not depend on the batch. Unseeded requests share
                # the sampler's generator, one draw for all of their rows (engine/sampler.py).
                seq.generator = torch.Generator(self.model.device).manual_seed((params.seed + i) % 2**64)
            if self.tokenizer is not None:
                seq.text = StopChecker(self.tokenizer, token_ids, params.stop, params.include_stop_str_in_output)
            if compiled is not None:  # one matcher per completion: each has its own place in the grammar
                seq.grammar = SequenceGrammar(compiled)
            group.seqs.append(seq)
        needed = self.block_manager.blocks_for(group.seqs[0].max_total_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"request {request_id!r} may need {needed} KV blocks, the pool only has "
                             f"{self.block_manager.num_blocks}: it could never run (a smaller max_tokens would help)")
        self.requests[request_id] = group
        for seq in group.seqs:
            self.scheduler.add(seq)
        return request_id

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids), refusing with ValueError the prompts that cannot be
        served. add_request calls it; a server calls it first, to know a prompt's length before
        queueing it (then passes the token ids). It reads only what never changes (tokenizer,
        vocabulary, max_model_len), so any thread may call it."""
        if isinstance(prompt, dict):
            keys = set(prompt)
            if len(keys) != 1 or not keys <= {"prompt", "prompt_token_ids"}:
                raise ValueError(f"a dict prompt holds one key, 'prompt' (text) or 'prompt_token_ids', got {sorted(keys)}")
            (key, prompt), = prompt.items()
            if (key == "prompt") != isinstance(prompt, str):
                raise ValueError(f"{key!r} must be {'a string' if key == 'prompt' else 'a list of token ids'}, "
                                 f"got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise ValueError(f"token ids must be integers, got {t!r} ({type(t).__name__}) at position {i}")
            text, token_ids = None, [int(t) for t in prompt]
        else:
            raise ValueError(f"a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                             f"'prompt_token_ids', got {type(prompt).__name__}")
        vocab = self.model.config.vocab_size
        if not token_ids:
            raise ValueError("empty prompt: a request needs at least one token")
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        return text, token_ids

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: n against the batch, the vocabulary, and a
        tokenizer for stop strings."""
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} completions cannot run side by side: at most max_num_seqs="
                             f"{self.scheduler.max_num_seqs}")
        vocab = self.model.config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in the vocabulary [0, {vocab}), got {list(params.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {getattr(params, name)}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none (stop_token_ids work without)")

    def _compile_constraint(self, params: SamplingParams) -> futures.Future | None:
        """Chapter 13: check the request's constraint now (ValueError) and start compiling it in
        the background; None for a request without one."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer (a grammar is written in text), and this "
                             "model has none")
        if self.grammars is None:
            self.grammars = XgrammarBackend(self.tokenizer, self.model.config.vocab_size, sorted(self.eos_token_ids))
        return self.grammars.compile(params.structured_outputs, self.config.disable_any_whitespace)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or several) now, all n of its completions, and free their blocks.
        Unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.requests.pop(rid, None)
            for seq in group.seqs if group is not None else []:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output (everything so far) for every request that
        got a new token, finished ones included (FINAL_ONLY requests: only when they finish).
        Under async scheduling (chapter 16) the outputs are those of the step before, finished
        while this one runs."""
        if self.overlap is not None:
            return self.overlap.step()
        schedule = self._schedule()
        return [] if schedule is None else self._finish(self._launch(schedule))

    def _schedule(self) -> SchedulerOutput | None:
        """Plan the next step; None when there is nothing to run."""
        if self.speculator is not None:
            with record_function("propose"):
                self.speculator.propose(self.scheduler.running)  # guesses join token_ids (chapter 12)
        with record_function("schedule"):
            schedule = self.scheduler.schedule()
            if self.speculator is not None:
                self.speculator.fit(schedule, self.scheduler.running, list(self.scheduler.waiting))
        if not schedule.seqs:
            if (self.scheduler.waiting or self.scheduler.running) and not schedule.preempted:
                raise RuntimeError(
                    f"Scheduler.schedule planned no tokens while {len(self.scheduler.waiting)} requests wait and "
                    f"{len(self.scheduler.running)} run, and preempted nobody: the engine would wait forever")
            compiling = {seq.grammar.compiled for seq in self.scheduler.waiting_for_grammar}
            if compiling:  # chapter 13: nothing else to run; wait a little for a grammar, not forever
                futures.wait(compiling, timeout=GRAMMAR_WAIT, return_when=futures.FIRST_COMPLETED)
            return None  # nothing queued, a step that only preempted, or only grammars compiling
        return schedule

    def _launch(self, schedule: SchedulerOutput, previous: SampledTokens | None = None) -> StepInFlight:
        """Run the model on a schedule and choose its tokens, leaving them on the device.
        previous: the last step's tokens, which this step's placeholders stand for (chapter 16)."""
        start = time.perf_counter()
        record = self.trace.record(schedule, self.scheduler) if self.trace is not None else None
        # The "prepare" and "forward" phases (given the last step's tokens only under async scheduling).
        run = self.runner.run
        rows, logits, prompt_logits = run(schedule) if previous is None else run(schedule, previous)
        with record_function("sample"):
            self._add_prompt_logprobs(schedule, prompt_logits)
            for seq, n in zip(schedule.seqs, schedule.num_new_tokens):
                seq.num_computed_tokens += n
            tokens = self._choose_tokens(logits, [schedule.seqs[i] for i in rows])
        return StepInFlight(tokens, record, start)

    def _finish(self, step: StepInFlight) -> list[RequestOutput]:
        """Append a launched step's tokens, retire the requests that finished, build the outputs."""
        sampled, chosen, record = step.tokens.seqs, step.tokens.chosen(), step.record
        if record is not None and self.speculator is not None:
            record.accepted = {seq.request_id: len(tokens) - 1 for seq, (tokens, _) in zip(sampled, chosen)
                               if seq.request_id in record.drafts}
        now = time.perf_counter()
        with record_function("finish"):
            # The requests that answer this step: every one that streams, and those that finished.
            # (A FINAL_ONLY request that goes on costs nothing more here: the common case of LLM.generate.)
            answering: dict[str, SequenceGroup] = {}
            for seq, (tokens, tops) in zip(sampled, chosen):
                if seq.is_finished:  # chapter 16: finished or aborted while this step ran; its token goes nowhere
                    continue
                self._append(seq, tokens, tops, now)
                params = seq.params
                if seq.finish_reason is not None:
                    seq.finish_time = now
                    self.scheduler.finish(seq)
                    answering[seq.group.request_id] = seq.group
                elif params.output_kind is RequestOutputKind.CUMULATIVE:
                    answering[seq.group.request_id] = seq.group
            outputs = []
            for group in answering.values():
                finished = group.is_finished
                if finished:
                    del self.requests[group.request_id]
                if finished or group.params.output_kind is RequestOutputKind.CUMULATIVE:
                    outputs.append(self._output(group))
        if record is not None:
            record.seconds = time.perf_counter() - step.start
        return outputs

    def _choose_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        """Each sequence's new tokens and their logprobs: one sampled token, or, after a verify
        chunk (chapter 12), its accepted guesses and one more. logits holds 1 + D rows for a
        sequence with D guesses, one for the others, in order."""
        guessed = [i for i, seq in enumerate(seqs) if seq.num_spec_tokens]
        if not guessed:
            return SampledTokens(seqs, *self.sampler.sample(logits, seqs, self.eos_token_ids))
        first_row = [0]
        for seq in seqs:
            first_row.append(first_row[-1] + 1 + seq.num_spec_tokens)
        plain = [i for i, seq in enumerate(seqs) if not seq.num_spec_tokens]
        chosen: list[tuple[list[int], list]] = [([], [])] * len(seqs)
        if plain:
            result = self.sampler(logits[[first_row[i] for i in plain]], [seqs[i] for i in plain], self.eos_token_ids)
            for i, token, top in zip(plain, result.token_ids, result.logprobs):
                chosen[i] = ([token], [top])
        rows = [r for i in guessed for r in range(first_row[i], first_row[i + 1])]
        verdicts = self.speculator.verify(logits[rows], [seqs[i] for i in guessed], self.block_manager)
        for i, verdict in zip(guessed, verdicts):
            seqs[i].num_draft_tokens += verdict.num_guesses
            seqs[i].num_accepted_tokens += len(verdict.token_ids) - 1
            chosen[i] = (verdict.token_ids, verdict.logprobs)
        return SampledTokens(seqs, chosen=chosen)

    def _append(self, seq: Sequence, tokens: list[int], tops: list, now: float) -> None:
        """Append a step's tokens one at a time, so that a stop token, a stop string or the
        length ends the request exactly where one-token-a-step decoding would: nothing after."""
        params = seq.params
        streamed = params.stop or params.output_kind is RequestOutputKind.CUMULATIVE
        for i, (token, top) in enumerate(zip(tokens, tops)):
            seq.append_token(token, self.eos_token_ids, now, None if top is None else self._logprob_dict(top))
            ended = seq.grammar is not None and seq.grammar.advance([token])  # chapter 13
            if ended and seq.finish_reason != "stop":  # the grammar has ended: so has the request
                seq.finish_reason, seq.stop_reason = "stop", None
            last = i == len(tokens) - 1 or seq.finish_reason is not None
            if seq.text is not None and (params.stop or (last and (streamed or seq.finish_reason is not None))):
                seq.update_text()  # may find a stop string and finish the sequence
            if seq.finish_reason is not None:
                return

    def _add_prompt_logprobs(self, schedule: SchedulerOutput, prompt_logits: dict[int, torch.Tensor]) -> None:
        """Logprobs of the prompt tokens this step computed, for the requests that asked. Row j
        of a sequence's prompt logits (its token at position start + j) predicts the token at
        start + j + 1. Runs before num_computed_tokens moves on (start is still the old one)."""
        for i, logits in prompt_logits.items():
            seq = schedule.seqs[i]
            filled, start = seq.group.prompt_logprobs, seq.num_computed_tokens
            first = len(filled)  # the next prompt position without logprobs (position 0 has none)
            last = min(start + schedule.num_new_tokens[i], seq.num_prompt_tokens - 1)
            if not start < first <= last:  # done already (another completion, or a recompute), or not reached
                continue
            targets = torch.tensor(seq.prompt_token_ids[first:last + 1], device=logits.device)
            k = seq.params.prompt_logprobs
            rows = logits[first - 1 - start:last - start].float().log_softmax(dim=-1)
            packed = top_logprobs(rows, targets, k).tolist()
            filled += [self._logprob_dict(top) for top in unpack_logprobs(packed, [k] * len(targets))]

    def _logprob_dict(self, top: TopLogprobs) -> dict[int, Logprob]:
        """vLLM's form of one position's logprobs: token id -> Logprob, the chosen token first."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return {t: Logprob(lp, rank, decode([t]) if decode else None)
                for t, lp, rank in zip(top.token_ids, top.logprobs, top.ranks)}

    def _output(self, group: SequenceGroup) -> RequestOutput:
        """A snapshot of the request: later steps do not change it."""
        seqs = group.seqs
        completions = [
            CompletionOutput(seq.index, seq.output_text(), seq.output_token_ids, seq.cumulative_logprob,
                             None if seq.logprobs is None else list(seq.logprobs), seq.finish_reason, seq.stop_reason)
            for seq in seqs
        ]
        first_tokens = [seq.first_token_time for seq in seqs if seq.first_token_time is not None]
        finished = group.is_finished
        metrics = RequestMetrics(min(seq.arrival_time for seq in seqs), min(first_tokens, default=None),
                                 max(seq.finish_time for seq in seqs) if finished else None,
                                 sum(seq.num_preemptions for seq in seqs), sum(seq.num_draft_tokens for seq in seqs),
                                 sum(seq.num_accepted_tokens for seq in seqs))
        prompt_logprobs = None if group.prompt_logprobs is None else list(group.prompt_logprobs)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished, metrics,
                             prompt_logprobs, sum(seq.num_cached_tokens for seq in seqs))
