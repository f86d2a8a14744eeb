"""Turn a checkpoint into a `Decoder`: a local Hugging Face folder, a hub id, an in-memory
transformers model, a bare config.json (random weights, for benchmarking real shapes), or
nothing at all (the small model that ships inside this package).

Configs are parsed with transformers' own config classes, so both the old
(`rope_theta` / `rope_scaling`) and the new (`rope_parameters`) styles work.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from minivllm.config import ModelConfig
from minivllm.model import Decoder

DEFAULT_MODEL = Path(__file__).parent / "default_model"
DRAFT_MODEL = Path(__file__).parent / "draft_model"  # same tokenizer, ~1M parameters: speculative decoding
CONFIGS = Path(__file__).parent / "configs"  # real model shapes, for random-weight benchmarks
SUPPORTED = ("llama", "qwen2", "qwen3")

Source = str | Path | Any  # a folder, a hub id, a config .json, or a transformers PreTrainedModel


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    # fp32 on CPU (bf16 matmuls are slow there and tests compare exactly); bf16 on GPU.
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def config_from_hf(hf: Any) -> ModelConfig:
    """Our ModelConfig from a transformers PretrainedConfig (Llama, Qwen2 or Qwen3)."""
    if hf.model_type not in SUPPORTED:
        raise ValueError(f"unsupported model type {hf.model_type!r}; minivllm supports {', '.join(SUPPORTED)}")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported (use_sliding_window=True in the config)")
    # transformers >= 5 keeps theta and scaling together in rope_parameters; older versions
    # have rope_theta plus an optional rope_scaling dict (whose type key was once "type").
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if not rope:
        rope = {**(getattr(hf, "rope_scaling", None) or {}), "rope_theta": hf.rope_theta}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"RoPE type {rope_type!r} is not supported; minivllm supports 'default' and 'llama3'")
    heads = hf.num_attention_heads
    attention_bias = bool(getattr(hf, "attention_bias", False))
    eos = getattr(hf, "eos_token_id", None)
    return ModelConfig(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        rope_type=rope_type,
        rope_scaling={k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")},
        # Qwen2 always has q/k/v biases and no o bias; Llama and Qwen3 use attention_bias for all four.
        qkv_bias=True if hf.model_type == "qwen2" else attention_bias,
        o_bias=False if hf.model_type == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=hf.model_type == "qwen3",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        init_std=getattr(hf, "initializer_range", 0.02),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
    )


def load_model(source: Source = None, device: str | None = None, dtype: torch.dtype | None = None) -> Decoder:
    """Load a Llama/Qwen2/Qwen3 checkpoint as a minivllm `Decoder` (in eval mode, no grads).

    source: None (the embedded default model), a local checkpoint folder, a path to a
    config.json (random weights with the real shape), a hub id, or a transformers model.
    """
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if source is None:
        source = DEFAULT_MODEL
    if isinstance(source, torch.nn.Module):  # an in-memory transformers model
        config, state = config_from_hf(source.config), source.state_dict()
        config.eos_token_ids = _generation_eos(source) or config.eos_token_ids
    else:
        path = _resolve(source)
        if path.is_file():  # a bare config: real shape, random weights
            config, state = read_config(path), None
        else:
            config, state = read_config(path / "config.json"), _read_weights(path)
            config.eos_token_ids = _generation_eos(path) or config.eos_token_ids
    with torch.device(device):
        model = Decoder(config)
    if state is None:
        _init_random(model, config.init_std)
    else:
        _load_state(model, state)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def load_tokenizer(source: Source = None) -> Any | None:
    """The checkpoint's tokenizer (transformers AutoTokenizer), or None if it has none."""
    from transformers import AutoTokenizer

    if source is None:
        source = DEFAULT_MODEL
    if isinstance(source, torch.nn.Module):
        source = getattr(source, "name_or_path", "") or ""
    path = _resolve(source) if source else None
    if path is None or path.is_file() or not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def _resolve(source: str | Path) -> Path:
    path = Path(source).expanduser()
    if path.exists():
        return path
    if isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", source):  # looks like a hub id
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
        except Exception as err:  # no network, unknown repo, gated repo...
            raise FileNotFoundError(f"no local folder {str(path)!r}, and downloading hub id {source!r} failed: {err}")
    raise FileNotFoundError(f"model path not found: {str(path)!r}")


def read_config(path: Path) -> ModelConfig:
    """Our ModelConfig from a config.json (a checkpoint's, or a bare one naming a real shape)."""
    from transformers import AutoConfig

    if not path.exists():
        raise FileNotFoundError(f"no config.json in {str(path.parent)!r}")
    fields = json.loads(path.read_text())
    model_type = fields.get("model_type")  # checked before transformers parses the file
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported model type {model_type!r} in {path}; minivllm supports {', '.join(SUPPORTED)}")
    if path.name == "config.json":
        return config_from_hf(AutoConfig.from_pretrained(str(path.parent)))
    return config_from_hf(AutoConfig.for_model(fields.pop("model_type"), **fields))


def _generation_eos(source: Path | torch.nn.Module) -> list[int]:
    """EOS ids from generation_config (which may list several, e.g. Llama 3's chat tokens)."""
    if isinstance(source, torch.nn.Module):
        eos = getattr(getattr(source, "generation_config", None), "eos_token_id", None)
    else:
        file = source / "generation_config.json"
        eos = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():  # sharded checkpoint: the index maps each tensor to its shard
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {str(folder)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _load_state(model: Decoder, state: dict[str, torch.Tensor]) -> None:
    # Hugging Face nests the decoder under "model." (model.layers.0...), the head sits outside.
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    unexpected = [n for n in unexpected if "rotary_emb" not in n]  # old checkpoints saved inv_freq
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


@torch.no_grad()
def _init_random(model: Decoder, std: float) -> None:
    """Random weights like transformers' init: N(0, std) matrices, zero biases, unit norms."""
    generator = torch.Generator(device=model.device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
