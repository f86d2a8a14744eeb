"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`,
`LLM.chat(messages)` and `LLM.get_tokenizer()`.

Under the hood it is the online engine (LLMEngine) in a loop: queue every prompt, step until
nothing is left, return the finished outputs in the order the prompts came in. Where the engine
core runs, in this thread or as N copies in processes of their own (data_parallel_size=N,
chapter 14), is LLMEngine's client's business (engine/core_client.py), not this module's.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from minivllm.core.trace import Trace
from minivllm.engine.core_client import InprocClient
from minivllm.engine.llm_engine import LLMEngine, Prompt
from minivllm.request.outputs import RequestOutput
from minivllm.request.sampling_params import RequestOutputKind, SamplingParams

Conversation = Sequence[dict[str, str]]  # [{"role": "user", "content": "..."}, ...]


class LLM:
    """An engine for offline batches. `model` may be a loaded minivllm Decoder or anything
    load_model accepts (None: the embedded default model); the engine's settings are keywords,
    as for LLMEngine (see config/engine.py), e.g. LLM(model, block_size=4, enable_prefix_caching=False).
    data_parallel_size=N runs N whole copies, each an engine core process: call shutdown() when done."""

    def __init__(self, model: Any = None, device: str | None = None, dtype: torch.dtype | None = None,
                 tokenizer: Any = None, **settings: Any):
        self.engine = LLMEngine(model, device, dtype, tokenizer, **settings)
        self._request_ids = itertools.count()  # LLM names its requests "0", "1", ... (as vLLM's does), in order

    @property
    def trace(self) -> Trace | None:
        """The engine core's record of every step (set it to Trace() to start one), when the core
        runs in this process; with data_parallel_size > 1 there is no step here to record."""
        return self.engine.core.trace if isinstance(self.engine.client, InprocClient) else None

    @trace.setter
    def trace(self, trace: Trace | None) -> None:
        if not isinstance(self.engine.client, InprocClient):
            if trace is not None:
                raise ValueError("a Trace records the steps of an engine in this process; with data_parallel_size > 1 "
                                 "the steps run in the cores' processes (trace one engine: data_parallel_size=1)")
            return
        self.engine.core.trace = trace

    def get_tokenizer(self) -> Any:
        """The tokenizer (None when the checkpoint has none)."""
        return self.engine.get_tokenizer()

    def shutdown(self) -> None:
        """Stop the engine's processes (data_parallel_size > 1; nothing to do for one engine in
        this process). The LLM cannot generate afterwards."""
        self.engine.shutdown()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt: a string, a list of token ids, or vLLM's {"prompt": text} or
        {"prompt_token_ids": ids}; one prompt or a list of them. sampling_params: one for all,
        or one per prompt. Returns one finished RequestOutput per prompt, in input order."""
        prompts = [prompts] if is_single_prompt(prompts) else prompts
        if not isinstance(prompts, list | tuple):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, list | tuple):
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        ids = self._add_all(prompts, sampling_params)
        finished: dict[str, RequestOutput] = {}
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not use_tqdm, transient=True) as progress:
            task = progress.add_task("", total=len(ids))
            try:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            progress.advance(task)
            except BaseException:  # an error or Ctrl-C: take back what is still running, leave the engine clean
                self.engine.abort_request([i for i in ids if i not in finished])
                raise
        return [finished[i] for i in ids]

    def chat(
        self, messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
        chat_template: str | None = None, add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer a conversation ([{"role": "user", "content": "..."}, ...]) or a list of them,
        through the tokenizer's chat template (or `chat_template`, a Jinja template), given
        chat_template_kwargs as more variables (vLLM's; say enable_thinking). Each
        RequestOutput's prompt is the rendered conversation."""
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: pass chat_template=... or use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(conversations, list | tuple):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts or a list of such lists, "
                             f"got {type(messages).__name__}")
        for c, conversation in enumerate(conversations):
            check_conversation(c, conversation)
        texts, prompts = [], []
        for conversation in conversations:
            text, token_ids = render_chat(tokenizer, conversation, chat_template, add_generation_prompt,
                                          template_kwargs=chat_template_kwargs)
            texts.append(text)
            prompts.append({"prompt_token_ids": token_ids})
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _add_all(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams]) -> list[str]:
        """Queue every prompt, or none: if one is refused, the ones already queued are taken
        back before the error goes up, so the engine is left as it was. LLM only wants each
        request's final output, so its requests are FINAL_ONLY: the engine builds no output for
        them while they run."""
        ids: list[str] = []
        final: dict[int, SamplingParams] = {}  # one FINAL_ONLY copy per distinct params object
        try:
            for prompt, p in zip(prompts, params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"expected SamplingParams, got {type(p).__name__}")
                if id(p) not in final:
                    final[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                request_id = next(i for i in map(str, self._request_ids) if i not in self.engine.requests)
                ids.append(self.engine.add_request(prompt=prompt, params=final[id(p)], request_id=request_id))
        except ValueError as err:
            self.engine.abort_request(ids)
            raise ValueError(f"prompt {len(ids)}: {err}") from err
        return ids


def is_single_prompt(prompts: Any) -> bool:
    """A string, a dict, or a list of token ids (rather than a list of prompts)."""
    if isinstance(prompts, str | dict):
        return True
    return isinstance(prompts, list | tuple) and bool(prompts) and isinstance(prompts[0], numbers.Integral)


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None, documents: list[dict[str, str]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The messages rendered by the tokenizer's chat template (or `chat_template`), and the token
    ids of that text. The template writes the special tokens itself, so encoding adds none (a
    BOS twice would change the prompt). Used by LLM.chat and the server's chat endpoint.
    continue_final_message: the text ends inside the last message (whatever the template writes
    after it is cut), so that the model continues it; tools: tool definitions, documents:
    retrieved documents (say {"title", "text"} dicts), for templates that render them;
    template_kwargs: more variables for the template (vLLM's chat_template_kwargs, such as
    enable_thinking; a template that does not read one ignores it). A template variable can be
    set here, a setting of the rendering cannot: a name that is one of apply_chat_template's
    own arguments (tokenize, chat_template, add_generation_prompt, ...) is a ValueError, since
    it would change what this function returns or go around its arguments."""
    template_kwargs = dict(template_kwargs or {})
    own = sorted(set(template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if own:
        raise ValueError(f"chat_template_kwargs cannot set {own}: they are settings of the rendering, not variables "
                         f"of the template (the request has fields for the ones that matter)")
    text = tokenizer.apply_chat_template(list(messages), chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tools=tools,
                                         documents=documents, **template_kwargs)
    return text, tokenizer.encode(text, add_special_tokens=False)


def check_conversation(c: int, conversation: Any) -> None:
    """A conversation is a non-empty list of {"role": str, "content": str} dicts."""
    if not isinstance(conversation, list | tuple) or not conversation:
        raise ValueError(f"conversation {c}: expected a non-empty list of messages, got {conversation!r}")
    for m, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"conversation {c}, message {m}: expected {{'role': str, 'content': str}}, got {message!r}")
