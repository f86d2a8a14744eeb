"""Tiny random Llama / Qwen2 / Qwen3 checkpoints that exercise every branch of model.py.

Weights use a larger init std than real models so the logits are peaked: greedy ties between
two tokens would otherwise make "same tokens as transformers" a coin toss on rounding.
"""
from __future__ import annotations

import json
import re
import runpy
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from minivllm.course import text
from minivllm.request.sampling_params import SamplingParams
from minivllm.request.sequence import Sequence

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, initializer_range=0.2, eos_token_id=None, bos_token_id=None)

CONFIGS = {
    # GQA 4:2, Llama 3 frequency scaling, untied head, attention bias off
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)),
    # q/k/v bias, tied head, GQA 4:1
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    # q/k RMSNorm, head_dim (32) wider than hidden/heads (16)
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}

# A chat template for the embedded model's tokenizer, which has none: the server checks render
# conversations through it.
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:{% endif %}")


def tiny_hf_model(family: str, seed: int = 0, vocab_size: int | None = None) -> transformers.PreTrainedModel:
    """vocab_size: another vocabulary than the tiny 97 (4,096 fits the embedded model's tokenizer)."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # transformers zero-initialises biases; random ones test that we load and add them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate for one prompt: the reference every stage must equal."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 97) -> list[list[int]]:
    """minivllm.course.text.random_prompts over the tiny models' vocabulary of 97."""
    return text.random_prompts(lengths, vocab, seed)


def random_qkv(model, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded q [T, Hq, D], k and v [T, Hkv, D] in the model's head layout."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, generator=g)
    return q, k, v


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v for one sequence, in float64, KV heads repeated for GQA.
    q [Tq, Hq, D], keys/values [Tk, Hkv, D], mask [Tq, Tk] -> [Tq, Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@contextmanager
def raises_runtime_error(match: str) -> Iterator[None]:
    """pytest.raises(RuntimeError, match=...) for checks that run exercises: a stub's
    NotImplementedError is a RuntimeError too, and must not be taken for the error the check
    expects. It goes through, so the student sees which exercise is still a stub."""
    try:
        yield
    except NotImplementedError:
        raise
    except RuntimeError as error:
        assert re.search(match, str(error)), f"expected a RuntimeError matching {match!r}, got: {error}"
    else:
        pytest.fail(f"expected a RuntimeError matching {match!r}; nothing was raised")


def unspecialised(kernel) -> tuple[set[str], set[str]]:
    """The arguments a Triton kernel is told not to specialise on: (do_not_specialize,
    do_not_specialize_on_alignment), for a compiled kernel or an interpreted one."""
    if hasattr(kernel, "params"):  # triton.runtime.JITFunction
        return ({p.name for p in kernel.params if p.do_not_specialize},
                {p.name for p in kernel.params if p.do_not_specialize_on_alignment})
    # The interpreter keeps triton.jit's options as they were given (older ones, 3.2 among them, on its rewriter).
    options = getattr(kernel, "kwargs", None) or kernel.rewriter.kwargs
    return set(options.get("do_not_specialize") or ()), set(options.get("do_not_specialize_on_alignment") or ())


def run_script(script: Path, args: list[str], folder: Path, results: str, figures: Iterable[str] = ()) -> dict[str, Any]:
    """Run a chapter or benchmark script as `python script *args` in `folder` (where its results
    and figures land), check that each named figure is a real picture (over 10 kB), and return
    its results JSON (benchmarks/results/{results}.json). The scripts turn gradients off for the
    whole process; they are on again afterwards as they were."""
    grad = torch.is_grad_enabled()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setattr(sys, "argv", [str(script), *args])
        runpy.run_path(str(script), run_name="__main__")
    torch.set_grad_enabled(grad)
    for name in figures:
        assert (folder / f"figures/{name}.png").stat().st_size > 10_000, name
    return json.loads((folder / f"benchmarks/results/{results}.json").read_text())


def make_seq(request_id: str, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    """A running sequence with `computed` of its tokens computed and the given block table."""
    seq = Sequence(request_id, tokens, SamplingParams(max_tokens=4), max_model_len=1000)
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq
