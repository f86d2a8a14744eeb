"""The engine core (chapters 7-16): the scheduler, the model runner and the sampler, and nothing
a user reads. Requests come in as token ids (`EngineCoreRequest`); each step goes out as, per
sequence that got tokens, only what is new: the step's token ids, their logprobs if asked, and
why it finished (`EngineCoreOutput`).

Each step is: scheduler.schedule() -> model_runner.run() -> sampler() -> append the new tokens,
retire the finished requests, in three parts: `schedule`, `launch` (run and sample, the tokens
left on the device) and `finish` (append, retire, the outputs). Synchronously they run in that
order; under async scheduling (chapter 16, async_scheduling.py) the core's `AsyncScheduler` runs
step N+1's schedule and launch before step N's finish, here in the core, so the overlap works
wherever the core runs (in the caller's thread or in a process of its own).

Text, stop strings and RequestOutputs are the frontend's (engine/output_processor.py); checks
and tokenizing are its input processor's (engine/input_processor.py). That split is what lets the
core run in a process of its own (core/process.py, chapter 15): what crosses between the two is small
and plain, and the core never waits on anything but the model.

A request for n completions (chapter 10) is a SequenceGroup of n sequences that the scheduler
runs independently; each sequence's output names its index. A request with structured_outputs
(chapter 13) has its grammar compiled here in the background (structured_outputs/); each of its
sequences gets a matcher, which the sampler asks for a mask and the step advances with the
sampled token. A grammar that has ended ends its sequence ("stop"), even with ignore_eos.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent import futures
from typing import Any

import torch
from torch.profiler import record_function

from minivllm.config.engine import EngineConfig
from minivllm.core.async_scheduling import AsyncScheduler, StepInFlight
from minivllm.core.block_manager import BlockManager
from minivllm.core.prefix_cache import PrefixCachingBlockManager
from minivllm.core.scheduler import Scheduler
from minivllm.core.spec_decode.speculator import Speculator
from minivllm.core.trace import Trace
from minivllm.distributed.direct_load import unloaded_model
from minivllm.kv_transfer import KVConnectorRole, make_connector
from minivllm.loader import load_model, load_tokenizer
from minivllm.machine import environment
from minivllm.model import Decoder
from minivllm.request.logprobs import top_logprobs, unpack_logprobs
from minivllm.request.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreStats,
)
from minivllm.request.sequence import SchedulerOutput, Sequence, SequenceGroup, Status
from minivllm.structured_outputs.backend import XgrammarBackend
from minivllm.structured_outputs.matcher import SequenceGrammar
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.sampled_tokens import SampledTokens
from minivllm.worker.sampler import Sampler

# The parts of a step, as named ranges in a torch.profiler trace (see minivllm/course/bench/profiling.py):
# planning, turning the plan into tensors, the model, choosing tokens, bookkeeping.
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "finish")
GRAMMAR_WAIT = 0.05  # seconds a step with nothing to run waits for a grammar to compile (then it returns)


class EngineCore:
    def __init__(self, model: Decoder, config: EngineConfig, tokenizer: Any = None):
        """model: a loaded Decoder; config: an EngineConfig resolved for it. tokenizer: only for
        compiling structured-output grammars (None: requests with a constraint are refused)."""
        self.model, self.config, self.tokenizer = model, config, tokenizer
        manager = PrefixCachingBlockManager if config.enable_prefix_caching else BlockManager
        self.block_manager = manager(config.num_kv_blocks, config.block_size)
        # Chapter 17: K/V to or from another instance (None without a kv_transfer_config).
        self.connector = make_connector(config, model, KVConnectorRole.SCHEDULER)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.connector, config.long_prefill_token_threshold)
        if config.tensor_parallel_size > 1:  # chapter 14: rank 0's runner, which also drives the other ranks
            from minivllm.executor.tensor_parallel import TensorParallelRunner

            self.runner = TensorParallelRunner(model, config)
        else:
            self.runner = ModelRunner(model, config)
        self.sampler = Sampler()  # chooses the tokens; keeps penalised requests' token counts between steps
        self.speculator = (Speculator(config.speculative_config, model, config, self.sampler)
                           if config.speculative_config is not None else None)  # chapter 12
        self.grammars: XgrammarBackend | None = None  # chapter 13: made at the first request with a constraint
        self.eos_token_ids = set(model.config.eos_token_ids)
        self.requests: dict[str, SequenceGroup] = {}  # unfinished requests by id (n completions each)
        self.trace: Trace | None = None  # set to Trace() to record every step
        # Chapter 16: step N+1 planned and launched while step N runs; not with speculation (its
        # proposals read the newest tokens).
        self.overlap = AsyncScheduler(self) if config.async_scheduling and self.speculator is None else None

    @classmethod
    def load(cls, model: Any, config: EngineConfig, tokenizer: Any = None, device: str | None = None,
             dtype: torch.dtype | None = None) -> EngineCore:
        """The core for a Decoder, or for a source to load here (load_model's: a checkpoint, a hub
        id, a config.json; with its tokenizer unless one is given). The one place the engine loads
        a model: in the caller's thread or in a core process alike. config: resolved here."""
        if not isinstance(model, Decoder):
            tokenizer = tokenizer or load_tokenizer(model)
            if config.tensor_parallel_size > 1:  # chapter 14: every rank reads its own shard, nobody the whole
                model = unloaded_model(model, device=device, dtype=dtype)
            else:
                model = load_model(model, device=device, dtype=dtype)
        return cls(model, config.resolve(model), tokenizer)

    def info(self) -> dict[str, Any]:
        """The facts a frontend needs (its checks, /server_info) and cannot know without the model."""
        config = self.config
        return {"vocab_size": self.model.config.vocab_size, "max_model_len": config.max_model_len,
                "block_size": config.block_size, "num_kv_blocks": config.num_kv_blocks,
                "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                "enable_prefix_caching": bool(config.enable_prefix_caching), "environment": environment(self.model)}

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a checked request (input_processor.py). Raises ValueError, touching nothing, for
        an id in use or a constraint that does not compile."""
        request_id, token_ids, params = request.request_id, request.prompt_token_ids, request.params
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model.config.vocab_size  # checked again here: a message from another process may be anything
        if not token_ids or any(not 0 <= t < vocab for t in token_ids) or len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"request {request_id!r}: the prompt must be 1 to max_model_len - 1 token ids in [0, {vocab})")
        compiled = self._compile_constraint(params)  # chapter 13: None without structured_outputs
        group = SequenceGroup(request_id, None, token_ids, params,
                              prompt_logprobs=None if params.prompt_logprobs is None else [None])
        for i in range(params.n):
            name = request_id if params.n == 1 else f"{request_id}#{i}"
            seq = Sequence(name, token_ids, params, self.config.max_model_len, request.arrival_time, index=i, group=group)
            if not params.greedy and params.seed is not None:  # completion i of a seeded request uses seed + i
                # A generator of its own: its tokens do not depend on the batch. Unseeded requests share
                # the sampler's generator, one draw for all of their rows (worker/sampler.py).
                seq.generator = torch.Generator(self.model.device).manual_seed((params.seed + i) % 2**64)
            if compiled is not None:  # one matcher per completion: each has its own place in the grammar
                seq.grammar = SequenceGrammar(compiled)
            group.seqs.append(seq)
        self.requests[request_id] = group
        for seq in group.seqs:
            self.scheduler.add(seq)

    def _compile_constraint(self, params: Any) -> futures.Future | None:
        """Chapter 13: start compiling the request's constraint in the background; None for a
        request without one."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer (a grammar is written in text), and this "
                             "model has none")
        if self.grammars is None:
            self.grammars = XgrammarBackend(self.tokenizer, self.model.config.vocab_size, sorted(self.eos_token_ids))
        return self.grammars.compile(params.structured_outputs, self.config.disable_any_whitespace)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests now, all n of their completions, and free their blocks. Unknown or
        finished ids are ignored."""
        for rid in request_ids:
            group = self.requests.pop(rid, None)
            for seq in group.seqs if group is not None else []:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)

    def abort_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """Stop single completions, as (request id, index): the frontend found a stop string in
        their text. Their request ends when all of its completions have."""
        for rid, index in sequences:
            group = self.requests.get(rid)
            if group is None:
                continue
            seq = group.seqs[index]
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
            if group.is_finished:
                del self.requests[rid]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineCoreStats:
        """Read-only counts of the scheduler and block manager, for /metrics' gauges."""
        scheduler, blocks = self.scheduler, self.block_manager
        deferred = len(scheduler.waiting_for_grammar)  # chapter 13: waiting for a grammar, not for room
        return EngineCoreStats(len(scheduler.running), len(scheduler.waiting) + deferred,
                               1 - blocks.num_free / blocks.num_blocks, blocks.queried_tokens, blocks.hit_tokens,
                               None if self.speculator is None else self.speculator.stats, scheduler.num_preemptions,
                               deferred)

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduled step; return what it added to every sequence that got tokens.
        Under async scheduling (chapter 16) that is the step before's news, finished while this
        one runs."""
        if self.overlap is not None:
            return self.overlap.step()
        schedule = self.schedule()
        return [] if schedule is None else self.finish(self.launch(schedule))

    def plans_need_tokens(self) -> bool:
        """Whether the next step can be planned only once this step's tokens are known: while a
        request has a grammar, its next mask depends on them (chapter 13), and so do the tokens
        its bad_words ban."""
        return any((self.grammars is not None and g.params.structured_outputs is not None) or g.params.bad_words
                   for g in self.requests.values())

    def schedule(self) -> SchedulerOutput | None:
        """Plan the next step; None when there is nothing to run."""
        if self.speculator is not None:
            with record_function("propose"):
                self.speculator.propose(self.scheduler.running)  # guesses join token_ids (chapter 12)
        with record_function("schedule"):
            schedule = self.scheduler.schedule()
            if self.speculator is not None:
                self.speculator.fit(schedule, self.scheduler.running, list(self.scheduler.waiting))
            if self.connector is not None:  # chapter 17: where loaded tokens go; what the worker moves
                schedule.kv_connector_metadata = self.connector.plan_step(schedule)
            now = time.perf_counter()
            for seq in schedule.seqs:  # /metrics: queue time ends, prefill time starts (a preemption's return does not count)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
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

    def launch(self, schedule: SchedulerOutput, previous: SampledTokens | None = None) -> StepInFlight:
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

    def finish(self, step: StepInFlight) -> list[EngineCoreOutput]:
        """Append a launched step's tokens, retire the sequences that finished, build the outputs."""
        sampled, chosen, record = step.tokens.seqs, step.tokens.chosen(), step.record
        if record is not None and self.speculator is not None:
            record.accepted = {seq.request_id: len(tokens) - 1 for seq, (tokens, _) in zip(sampled, chosen)
                               if seq.request_id in record.drafts}
        now = time.perf_counter()
        # Once per sequence, every step: kept to a few attribute reads and one call each (at
        # batch 256 every 100 ns here is 26 µs of host time per step).
        eos_token_ids, finished = self.eos_token_ids, Status.FINISHED
        with record_function("finish"):
            outputs = []
            for seq, (tokens, tops) in zip(sampled, chosen):
                # Chapter 16: finished (its end was in the step before) or aborted (a stop string,
                # a disconnect) while this step ran: its extra token goes nowhere.
                if seq.status is finished:
                    continue
                if len(tokens) == 1 and seq.grammar is None:  # the common case: _append's, in one call
                    seq.append_token(tokens[0], eos_token_ids, now)
                else:
                    appended = self._append(seq, tokens, now)
                    tokens, tops = tokens[:appended], tops[:appended]
                if seq.finish_reason is not None:
                    seq.finish_time = now
                    self.scheduler.finish(seq)
                    if seq.group.is_finished:
                        del self.requests[seq.group.request_id]
                outputs.append(self._output(seq, tokens, tops))
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

    def _append(self, seq: Sequence, tokens: list[int], now: float) -> int:
        """Append a step's tokens one at a time, so that a stop token, the grammar's end or the
        length ends the sequence exactly where one-token-a-step decoding would: nothing after.
        Returns how many were appended."""
        for i, token in enumerate(tokens):
            seq.append_token(token, self.eos_token_ids, now)
            ended = seq.grammar is not None and seq.grammar.advance([token])  # chapter 13
            if ended and seq.finish_reason != "stop":  # the grammar has ended: so has the sequence
                seq.finish_reason, seq.stop_reason = "stop", None
            if seq.finish_reason is not None:
                return i + 1
        return len(tokens)

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
            filled += unpack_logprobs(packed, [k] * len(targets))

    def _output(self, seq: Sequence, tokens: list[int], tops: list) -> EngineCoreOutput:
        """The step's news for one sequence (prompt logprobs: those its request has not sent yet)."""
        group = seq.group
        prompt_logprobs = None
        if group.prompt_logprobs is not None and group.num_prompt_logprobs_sent < len(group.prompt_logprobs):
            prompt_logprobs = group.prompt_logprobs[group.num_prompt_logprobs_sent:]
            group.num_prompt_logprobs_sent = len(group.prompt_logprobs)
        stop_reason = seq.stop_reason if isinstance(seq.stop_reason, int) else None
        return EngineCoreOutput(group.request_id, seq.index, tokens,
                                None if seq.params.logprobs is None else tops, prompt_logprobs,
                                seq.finish_reason, stop_reason, seq.first_token_time, seq.num_preemptions,
                                seq.num_cached_tokens, seq.num_draft_tokens, seq.num_accepted_tokens,
                                seq.first_scheduled_time or 0.0)
