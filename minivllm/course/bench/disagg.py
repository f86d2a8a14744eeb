"""Measuring chapter 17: what a KV connector does, and what disaggregated prefill buys.

- `record_calls` logs every connector call an LLM makes, on both halves (and keeps each step's
  plan of loads and saves), so that one request's path through a producer and a consumer can be
  printed in order;
- `steps_beside_a_long_prompt` times the steps of a batch of decoding requests when a long prompt
  arrives: computed in the same engine (the stall disaggregation removes), or loaded by a
  consumer from the blocks a producer wrote;
- `load_or_compute` times one prompt's first token: computed by one engine, or loaded.
Used by chapters/17_disaggregated_prefill.py and notebooks/17_disaggregated_prefill.ipynb.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any

from minivllm.core.trace import Trace
from minivllm.course.text import random_prompts
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.kv_transfer.base import KVConnectorMetadata
from minivllm.model import Decoder
from minivllm.request.sampling_params import SamplingParams

CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
         "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")


def transfer_config(role: str, folder: str) -> dict:
    """A SharedStorageConnector's kv_transfer_config for `role` ("kv_producer", "kv_consumer"), in `folder`."""
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder}}


def describe(value: Any) -> str:
    """A call's argument or result, short: a request by id, a step's plan by its sizes."""
    if isinstance(value, KVConnectorMetadata):
        return f"meta(loads={len(value.loads)} blocks, saves={len(value.saves)} blocks)"
    if hasattr(value, "request_id"):
        return f"request {value.request_id!r}"
    if hasattr(value, "num_new_tokens"):
        return f"schedule({dict(zip([s.request_id for s in value.seqs], value.num_new_tokens))})"
    if hasattr(value, "k") and hasattr(value, "num_blocks"):
        return "pool"
    return repr(value)


def record_calls(llm: LLM, name: str, log: list[str], plans: list[KVConnectorMetadata] | None = None) -> None:
    """Wrap the connector methods of both halves of llm's connector so that each call is logged
    to `log` as "name side method(args) -> result". Per-layer calls are logged for layer 0 only
    (the others repeat it), and steps that move nothing (a decode: build_connector_meta's plan is
    empty) not at all. `plans`, if given, receives every plan that moves something, in order."""
    core = llm.engine.core
    for side, connector in (("scheduler", core.connector), ("worker", core.runner.connector)):
        for method in CALLS:
            original = getattr(connector, method)

            @functools.wraps(original)
            def logged(*args, _original=original, _method=method, _side=side, _connector=connector):
                result = _original(*args)
                plan = {"build_connector_meta": result, "bind_connector_metadata": args[0] if args else None}.get(
                    _method, _connector._meta if _side == "worker" else None)
                idle = plan is not None and not plan.loads and not plan.saves
                if not idle and not (_method in ("wait_for_layer_load", "save_kv_layer") and args[0] != 0):
                    shown = ", ".join(map(describe, args))
                    suffix = f" -> {describe(result)}" if result is not None else ""
                    log.append(f"{name:9} {_side:9} {_method}({shown}){suffix}")
                if plans is not None and _method == "build_connector_meta" and not idle:
                    plans.append(result)
                return result
            setattr(connector, method, logged)


def steps_beside_a_long_prompt(model: Decoder, folder: str | None, decoders: int = 8, short: int = 32,
                               long: int = 480, budget: int = 512, seed: int = 0) -> list[dict]:
    """Each step of `decoders` requests (prompts of `short` tokens) decoding while a prompt of
    `long` tokens arrives, from the step after their prefill until the long one has its 4 tokens.

    folder None: one engine computes everything, the long prefill in a step beside the decodes
    (`budget` = max_num_batched_tokens; below `long` it is chunked, chapter 5). folder given: a
    producer computes every prompt first (max_tokens=1) and a consumer, which runs the decodes,
    loads their blocks from `folder` and computes only each prompt's tail (the last token, and
    what does not fill a block). Returns, per step: ms, prefill_tokens (prompt tokens computed),
    decodes (requests that computed one new token)."""
    vocab = model.config.vocab_size
    prompts = random_prompts([short] * decoders, vocab, seed=seed)
    long_prompt = random_prompts([long], vocab, seed=seed + 1)[0]
    settings = dict(block_size=16, max_model_len=model.config.max_position_embeddings,
                    max_num_batched_tokens=budget, enable_prefix_caching=False)
    if folder is not None:
        producer = LLM(model, kv_transfer_config=transfer_config("kv_producer", folder), **settings)
        producer.generate(prompts + [long_prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        settings["kv_transfer_config"] = transfer_config("kv_consumer", folder)
    engine = LLMEngine(model, **settings)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # their prefill, and the first decodes (which pay one-time costs): not recorded
        engine.step()
    engine.core.trace = Trace()
    for step in range(12):
        if step == 4:
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.step()
    return [dict(ms=1e3 * r.seconds, prefill_tokens=r.num_prefill_tokens, decodes=len(r.decode))
            for r in engine.core.trace.steps]


def first_token_seconds(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """Wall and CPU seconds (every thread of this process) to generate one token for one prompt:
    its prefill, or its load and the last token. On a shared machine the CPU time is the steadier."""
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def load_or_compute(model: Decoder, lengths: list[int], repeats: int, folder: str) -> list[dict]:
    """Time to first token of one prompt: computed by one engine, or loaded by a consumer from
    the files a producer wrote (medians of `repeats`, each on fresh prompts: no prefix cache helps).
    One row per length: prompt_tokens, loaded_tokens, transfer_bytes, compute_ms, load_ms (wall)
    and compute_cpu_ms, load_cpu_ms (CPU time of this process)."""
    settings = dict(block_size=16, max_model_len=max(lengths) + 16, enable_prefix_caching=False,
                    max_num_batched_tokens=max(lengths))
    alone = LLM(model, **settings)
    producer = LLM(model, kv_transfer_config=transfer_config("kv_producer", folder), **settings)
    consumer = LLM(model, kv_transfer_config=transfer_config("kv_consumer", folder), **settings)
    bytes_per_token = model.config.kv_bytes_per_token(model.dtype)
    warm = random_prompts([min(lengths)], model.config.vocab_size, seed=1)[0]
    for llm in (alone, producer, consumer):  # first calls pay one-time costs: not what is measured
        first_token_seconds(llm, warm)
    rows = []
    for length in lengths:
        prompts = random_prompts([length] * repeats, model.config.vocab_size, seed=length)
        computed = [first_token_seconds(alone, p) for p in prompts]
        for p in prompts:
            producer.generate([p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        loaded = [first_token_seconds(consumer, p) for p in prompts]
        moved = (length - 1) // 16 * 16  # the full blocks before the last token, which is always computed
        rows.append(dict(prompt_tokens=length, loaded_tokens=moved, transfer_bytes=moved * bytes_per_token,
                         compute_ms=1e3 * statistics.median(w for w, _ in computed),
                         load_ms=1e3 * statistics.median(w for w, _ in loaded),
                         compute_cpu_ms=1e3 * statistics.median(c for _, c in computed),
                         load_cpu_ms=1e3 * statistics.median(c for _, c in loaded)))
    return rows
