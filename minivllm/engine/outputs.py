"""What the engine hands back for a request, shaped like vLLM's outputs (chapter 7)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int  # which completion of the request (always 0: one completion per request)
    token_ids: list[int]
    finish_reason: str | None  # "length", "stop", or None while still generating
    tokenizer: Any = field(default=None, repr=False)

    @property
    def text(self) -> str:
        """The decoded output ("" when the checkpoint has no tokenizer). Decoded when first
        read: a streaming engine makes an output every step, most are never looked at."""
        if self._text is None:
            self._text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return self._text

    _text: str | None = field(default=None, init=False, repr=False)


@dataclass
class RequestMetrics:
    """perf_counter() times, in seconds. TTFT = first_token_time - arrival_time."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0  # times its KV cache was thrown away and recomputed


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
