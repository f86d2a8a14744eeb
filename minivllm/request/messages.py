"""What crosses between the frontend and the core process (chapter 15), as msgspec structs in
msgpack over ZMQ sockets.

Why msgspec and not pickle: a step at batch 128 sends 128 small records, every few
milliseconds; msgspec encodes and decodes typed structs several times faster than pickle and
refuses a malformed message instead of running it. Why ZMQ: message framing, queueing while the
other side is busy, and IPC sockets, with nothing to run in between.

Frontend -> core: AddRequest, Abort (whole requests), StopSequences (completions that a stop
string ended in the frontend), Taken (how many steps' outputs the frontend has taken in: the
core runs at most a step or two ahead of a frontend that says so), Shutdown. Core -> frontend: Ready once (then the resolved engine
facts), then per step a StepOutputs (the step's EngineCoreOutputs and the core's gauges), a
Refused for a request the core could not take (it fails alone), and Failed once if the core
itself breaks (then it exits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from minivllm.request.logprobs import TopLogprobs
from minivllm.request.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """A request as the core sees it: token ids, never text (the text stays with the frontend).
    arrival_time: time.perf_counter() when it arrived (a system-wide monotonic clock on Linux,
    so the core process reads the same clock)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class SpecDecodeStats:
    """Counters since the engine started, as vLLM reports them: a draft is one sequence's
    guesses in one step; acceptance per position j counts drafts whose guess j + 1 was kept."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts_per_position: list[int] = field(default_factory=list)  # drafts that had a guess j + 1
    num_accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_drafts_per_position = self.num_drafts_per_position or [0] * self.k
        self.num_accepted_per_position = self.num_accepted_per_position or [0] * self.k

    def add(self, num_guesses: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_guesses
        self.num_accepted_tokens += num_accepted
        for j in range(num_guesses):
            self.num_drafts_per_position[j] += 1
            self.num_accepted_per_position[j] += j < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_draft(self) -> float:
        """Tokens a speculating sequence gained per target forward (accepted guesses + 1)."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did for one sequence: completion `index` of request `request_id`.

    new_token_ids: this step's tokens (one, or after a verify step several). new_logprobs: one
    TopLogprobs (as [token ids, logprobs, ranks], the chosen token first) per new token, if the
    request asked. prompt_logprobs: prompt positions' logprobs computed since the request's last
    output (position 0 as None), if it asked. finish_reason: "stop", "length" or None.
    The counters are the sequence's totals so far (for RequestMetrics); scheduled_time is when
    a step first gave it tokens (time.perf_counter(), as first_token_time)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[TopLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    first_token_time: float = 0.0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    scheduled_time: float = 0.0


class EngineCoreStats(msgspec.Struct, array_like=True):
    """The core's state after a step, for /metrics: requests running and waiting, the KV pool's
    use (0-1), the prefix cache's running sums, speculation's totals, preemptions since the start,
    and how many of the waiting requests wait for their grammar to compile rather than for room
    (vLLM's "deferred" waiting; the rest wait for "capacity")."""

    running: int
    waiting: int
    kv_cache_usage: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    spec: SpecDecodeStats | None = None
    num_preemptions: int = 0
    waiting_deferred: int = 0




class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request: EngineCoreRequest


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StopSequences(msgspec.Struct, tag=True, array_like=True):
    sequences: list[tuple[str, int]]  # (request id, completion index)


class Taken(msgspec.Struct, tag=True, array_like=True):
    steps: int  # StepOutputs of a step (step_end > 0) the frontend has taken in since the core started


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Followed by one pickled message, once: (the engine's facts for /server_info, the resolved
    EngineConfig), which hold objects msgspec does not encode and cost nothing once."""

    pid: int


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: EngineCoreStats
    step_start: float = 0.0  # time.perf_counter() around the step (0: no step ran, only the gauges changed)
    step_end: float = 0.0


class Refused(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    message: str
    bad_request: bool  # True: the request itself was at fault (a 400); False: the core failed on it (a 500)


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str


ToCore = AddRequest | Abort | StopSequences | Taken | Shutdown
FromCore = Ready | StepOutputs | Refused | Failed
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
encoder = msgspec.msgpack.Encoder()
