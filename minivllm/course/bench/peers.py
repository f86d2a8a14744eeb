"""What a user would otherwise reach for: transformers' own batched generation, run on the same
prompts and output lengths as minivllm, for side-by-side benchmarks (chapter 7, the tour).

Both runners are greedy and ignore EOS, like the stages, and return each request's own
tokens (exactly output_lens[i] of them), so outputs can be checked against minivllm's.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.model import Decoder


def _greedy_config(max_new_tokens: int) -> Any:
    """A GenerationConfig that is greedy and never stops early (no EOS)."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0, bos_token_id=None)


def token_positions(prompts: list[list[int]], output_lens: list[int], batch_size: int) -> tuple[int, int]:
    """(needed, padded): token positions the workload needs pushed through the model (each
    prompt and all but the last output token), and what static batches of `batch_size`
    compute instead (every row to its batch's longest prompt plus longest output)."""
    needed = sum(len(p) + n - 1 for p, n in zip(prompts, output_lens))
    padded = 0
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b:b + batch_size], output_lens[b:b + batch_size]
        padded += len(batch) * (max(map(len, batch)) + max(lens) - 1)
    return needed, padded


@torch.inference_mode()
def hf_static_generate(hf_model: Any, prompts: list[list[int]], output_lens: list[int], batch_size: int = 16) -> list[list[int]]:
    """Static batching, as `model.generate` does it: consecutive batches of `batch_size`
    prompts, left-padded to the batch's longest prompt, each batch run for its longest output.
    Rows keep computing after their own request is done; only their own tokens are returned."""
    device = hf_model.device
    outputs: list[list[int]] = []
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b:b + batch_size], output_lens[b:b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = hf_model.generate(input_ids=ids, attention_mask=mask, generation_config=_greedy_config(max(lens)))
        outputs += [row[width:width + n].tolist() for row, n in zip(out, lens)]
    return outputs


# The first transformers whose continuous batching minivllm drives: its cache is sized by a
# ContinuousBatchingConfig (new in 5.4, whose 5.4.0 crashes on a CPU). Older versions still serve
# as the reference every stage is checked against; only this peer needs the newer one.
CONTINUOUS_BATCHING_SINCE = "5.5"


class PeerUnavailable(RuntimeError):
    """The installed transformers cannot run this peer: the tour and benchmarks say why, tests skip."""


def continuous_batching_unavailable() -> str | None:
    """Why `hf_generate_batch` cannot run with the installed transformers, or None if it can."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(CONTINUOUS_BATCHING_SINCE):
        return (f"transformers {transformers.__version__} has no continuous batching that minivllm can drive "
                f"(needs transformers>={CONTINUOUS_BATCHING_SINCE}); upgrade it, or leave the peers out (--no-peers)")
    return None


@dataclass(frozen=True)
class PeerSettings:
    """How transformers' continuous batching is run: every number it gives is saved beside these.

    transformers' guide (Continuous batching, v5.x) loads the model with a flash attention
    implementation on a GPU ("flash_attention_2"; "sdpa_paged" in older pages) and otherwise lets
    the manager choose: it switches sdpa or eager to flash where a flash package is installed, to
    "paged|eager" for eager, and sizes its batch, CUDA graphs and compile settings itself. None
    below means exactly that: transformers decides. benchmarks/peer_settings.py measures the
    choices on a GPU; PEER_SETTINGS is what the benchmarks use."""

    attn_implementation: str | None = None  # None: the model's own ("sdpa"), or flash if transformers finds it
    max_batch_tokens: int | None = 2048  # tokens per step; None: transformers' default (8,192 in 5.24)
    use_cuda_graph: bool | None = None  # None: transformers decides (on for CUDA where it can)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PEER_SETTINGS = PeerSettings()


def _cb_config(settings: PeerSettings, num_blocks: int) -> Any:
    """A ContinuousBatchingConfig of `num_blocks` blocks with the settings this transformers has
    (a field it lacks is left out: None settings are its default anyway, others raise)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = set(inspect.signature(ContinuousBatchingConfig).parameters)
    wanted = dict(num_blocks=num_blocks, max_batch_tokens=settings.max_batch_tokens,
                  use_cuda_graph=settings.use_cuda_graph)
    missing = [name for name, value in wanted.items() if value is not None and name not in fields]
    if missing:
        raise PeerUnavailable(f"this transformers' ContinuousBatchingConfig has no {', '.join(missing)}")
    return ContinuousBatchingConfig(**{name: value for name, value in wanted.items() if name in fields})


@contextmanager
def continuous_batching(hf_model: Any, prompts: list[list[int]], output_lens: list[int],
                        settings: PeerSettings = PEER_SETTINGS) -> Iterator[Any]:
    """transformers' continuous batching manager (transformers >= 5.5), started with `settings` and
    a cache that holds every one of these requests at once, then stopped on exit. Starting and
    stopping it are set-up (its stop alone ran gc.collect twice, 2.4 s on a CPU), as building an
    engine is: a benchmark times `generate_on` inside, not this.

    The cache is sized explicitly: left to itself, transformers sizes it from the device's free
    memory (on a CPU, the machine's whole memory: slow to allocate). On a CPU, transformers up to
    5.20 also needs psutil to see that memory at all."""
    if reason := continuous_batching_unavailable():
        raise PeerUnavailable(reason)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    defaults = ContinuousBatchingConfig()
    page = getattr(defaults, "page_size", None) or defaults.block_size  # tokens per block: "block_size" until 5.17
    blocks = sum(-(-(len(p) + n) // page) for p, n in zip(prompts, output_lens))
    cb_config = _cb_config(settings, blocks)
    if settings.attn_implementation is not None:
        hf_model.set_attn_implementation(settings.attn_implementation)
    # Its logger warns that EOS is unset on every call: expected here (no EOS on purpose).
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    with torch.no_grad(), hf_model.continuous_batching_context_manager(  # not inference_mode: the manager's
            generation_config=_greedy_config(max(output_lens)),  # thread updates tensors made here in place
            continuous_batching_config=cb_config, block=True, timeout=5) as manager:
        yield manager


_REQUEST_NUMBERS = itertools.count()  # request ids unique across runs on one manager (a warm-up, then the timed run)


def generate_on(manager: Any, prompts: list[list[int]], output_lens: list[int],
                deadline: float | None = None) -> list[list[int] | None]:
    """Each request's own number of greedy tokens from a running manager (continuous_batching).
    `generate_batch` takes one max_new_tokens for all requests, so we drive the manager it wraps
    ourselves: the same work minivllm does, not the longest output for all. With a `deadline` (a
    time.perf_counter() value) it stops there: the requests not finished by then come back as
    None (without one, every request comes back)."""
    ids = [manager.add_request(p, request_id=f"req_{next(_REQUEST_NUMBERS)}", max_new_tokens=n, eos_token_id=-1)
           for p, n in zip(prompts, output_lens)]
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        if deadline is not None and time.perf_counter() > deadline:
            break
        result = manager.get_result(timeout=1)  # not streaming: a request comes back once, finished or failed
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped unexpectedly")
            continue
        if result.error:
            raise RuntimeError(f"transformers' continuous batching failed {result.request_id}: {result.error}")
        results[result.request_id] = list(result.generated_tokens)
    return [results[i][:n] if i in results else None for i, n in zip(ids, output_lens)]


def hf_generate_batch(hf_model: Any, prompts: list[list[int]], output_lens: list[int],
                      settings: PeerSettings = PEER_SETTINGS, deadline: float | None = None) -> list[list[int] | None]:
    """continuous_batching and generate_on in one call (a manager started and stopped for it)."""
    with continuous_batching(hf_model, prompts, output_lens, settings) as manager:
        return generate_on(manager, prompts, output_lens, deadline)


def to_transformers(model: Decoder) -> Any:
    """A transformers model with exactly our weights: the reference for the agreement check."""
    import transformers

    cfg = model.config
    kind = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, **cfg.rope_scaling}
    hf_config = kind[cfg.model_type](
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=rope if cfg.rope_type != "default" else None,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias,
    )
    with torch.device(model.device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=model.dtype)
    state = {("" if name.startswith("lm_head") else "model.") + name: t for name, t in model.state_dict().items()}
    hf.load_state_dict(state, strict=False)
    hf.generation_config.eos_token_id = None  # like the stages: exactly the requested number of tokens
    hf.generation_config.pad_token_id = 0
    return hf.eval()
