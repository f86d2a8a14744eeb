"""The front door (chapter 15): a prompt and its SamplingParams checked and turned into the one
message the engine core takes, an `EngineCoreRequest` of token ids.

Why a piece of its own: everything here depends only on things that never change while the
engine runs (the tokenizer, the vocabulary, max_model_len, the KV pool's size), so it can run
anywhere: in the caller's thread for `LLM`, or in the server's process while the core steps in
another one. Refusing a request here costs the core nothing, and the core never has to refuse
one: by the time a request reaches it, it is known to fit.

What it does not do: compile a structured-output grammar. It *parses* the constraint (well
under a millisecond; a constraint that means nothing is a ValueError now) and leaves the
compile, which walks the vocabulary, to the core that will apply the grammar's masks.
"""
from __future__ import annotations

import itertools
import numbers
import time
from typing import Any

from minivllm.config.engine import EngineConfig
from minivllm.request.messages import EngineCoreRequest
from minivllm.request.sampling_params import SamplingParams
from minivllm.structured_outputs.backend import import_xgrammar, parse

AUTO_ID_PREFIX = "auto-"  # request ids the engine chooses; callers may not use it
Prompt = str | list[int] | dict[str, Any]  # text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}


class InputProcessor:
    """Checks and tokenizes requests for one model and engine configuration (a resolved
    EngineConfig). It holds no per-request state, so any thread may call it."""

    def __init__(self, tokenizer: Any, vocab_size: int, config: EngineConfig):
        self.tokenizer, self.vocab_size, self.config = tokenizer, vocab_size, config
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def process(self, request_id: str | None, prompt: Prompt, params: SamplingParams | None,
                arrival_time: float | None = None) -> tuple[str | None, EngineCoreRequest]:
        """(the prompt's text or None, the core's request). request_id: any string not starting
        with "auto-"; None picks one. Raises ValueError for anything the engine cannot serve."""
        if isinstance(prompt, SamplingParams) or (prompt is None and isinstance(request_id, dict | list)):
            raise ValueError("add_request takes (request_id, prompt, params), vLLM's order: pass them by keyword, "
                             "add_request(request_id=..., prompt=..., params=...)")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"{AUTO_ID_PREFIX}{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id or request_id.startswith(AUTO_ID_PREFIX):
            raise ValueError(f"request_id must be a non-empty string not starting with {AUTO_ID_PREFIX!r} (those are "
                             f"the engine's own), got {request_id!r}")
        text, token_ids = self.tokenize(prompt)
        params = params.for_model(self.tokenizer, self.vocab_size)  # bad_words as token ids; ids in the vocabulary
        self.check_params(params, len(token_ids), request_id)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        return text, EngineCoreRequest(request_id, token_ids, params, arrival)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(the text or None, the token ids), refusing with ValueError the prompts that cannot be
        served. A server calls it first, to know a prompt's length before queueing it."""
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
            # Plain ints (what JSON gives) are checked by type at a few tens of ns each; anything else
            # (a numpy integer, a bool, a float) goes through numbers.Integral, an ABC check ~20x
            # slower: for a server, ~1 µs a token id on the event loop (measured on this course's CPU).
            if all(type(t) is int for t in prompt):
                token_ids = list(prompt)
            else:
                for i, t in enumerate(prompt):
                    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                        raise ValueError(f"token ids must be integers, got {t!r} ({type(t).__name__}) at position {i}")
                token_ids = [int(t) for t in prompt]
            text = None
        else:
            raise ValueError(f"a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                             f"'prompt_token_ids', got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("empty prompt: a request needs at least one token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        return text, token_ids

    def check_params(self, params: SamplingParams, num_prompt_tokens: int, request_id: str = "") -> None:
        """What SamplingParams cannot check alone: n against the batch, the vocabulary, a
        tokenizer for stop strings and constraints, the constraint itself, and the KV pool."""
        config, vocab = self.config, self.vocab_size
        if params.n > config.max_num_seqs:
            raise ValueError(f"n={params.n} completions cannot run side by side: at most max_num_seqs="
                             f"{config.max_num_seqs}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in the vocabulary [0, {vocab}), got {list(params.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {getattr(params, name)}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none (stop_token_ids work without)")
        if params.structured_outputs is not None:
            self.check_constraint(params)
        # The most tokens one completion can hold in the cache (its last sampled token is never computed).
        limit = self.max_model_len if params.max_tokens is None else min(num_prompt_tokens + params.max_tokens,
                                                                          self.max_model_len)
        needed = -(-(limit - 1) // config.block_size)
        if needed > config.num_kv_blocks:
            raise ValueError(f"request {request_id!r} may need {needed} KV blocks, the pool only has "
                             f"{config.num_kv_blocks}: it could never run (a smaller max_tokens would help)")

    def check_constraint(self, params: SamplingParams) -> None:
        """Chapter 13: parse the request's constraint (ValueError if it means nothing); the core compiles it."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer (a grammar is written in text), and this "
                             "model has none")
        import_xgrammar()
        constraint = params.structured_outputs
        disable = (constraint.disable_any_whitespace if constraint.disable_any_whitespace is not None
                   else self.config.disable_any_whitespace)
        parse(constraint, constraint.is_json and not disable)
