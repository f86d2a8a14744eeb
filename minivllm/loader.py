"""Turn a checkpoint into a `Decoder`: a local Hugging Face folder, a hub id, an in-memory
transformers model, a bare config.json (random weights, for benchmarking real shapes), or
nothing at all (the small model that ships inside this package).

Configs are parsed with transformers' own config classes, so both the old
(`rope_theta` / `rope_scaling`) and the new (`rope_parameters`) styles work.

Weights are read piece by piece (`Weights.piece(name, rows, cols)`): `load_model` asks for every
parameter whole, and chapter 14's ranks ask only for their slices (distributed/direct_load.py), so
that no process ever holds more than its share. A checkpoint's pieces come from its safetensors
files (`safe_open(...).get_slice`, which reads only the bytes asked for); a bare config's random
weights are a function of (parameter name, block of rows) alone, drawn from a generator seeded
with both, so a rank that draws only its rows gets exactly the values the whole model has.
"""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from minivllm.model import Decoder, ModelConfig, RotaryEmbedding

DEFAULT_MODEL = Path(__file__).parent / "default_model"
DRAFT_MODEL = Path(__file__).parent / "draft_model"  # same tokenizer, ~1M parameters: speculative decoding
CONFIGS = Path(__file__).parent / "configs"  # real model shapes, for random-weight benchmarks
SUPPORTED = ("llama", "qwen2", "qwen3")

Source = str | Path | Any  # a folder, a hub id, a config .json, or a transformers PreTrainedModel
RANDOM_ROWS = 64  # random weights are drawn in blocks of this many rows, each block from its own seed


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
    weights = open_weights(source, device)
    with torch.device("meta"):  # the skeleton costs nothing: every parameter is filled from `weights` below
        model = Decoder(weights.config)
    model.rotary = RotaryEmbedding(weights.config)  # not a parameter: computed, on the CPU, not on meta
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            if module is model.lm_head and weights.config.tie_word_embeddings:
                continue  # tied below
            tensor = weights.piece(full).to(device=device, dtype=dtype)
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))
    if weights.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


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


class Weights:
    """A model's config and its weights, read piece by piece. Names are the Decoder's
    (`layers.0.self_attn.q_proj.weight`); rows and cols select along the first and second axis."""

    config: ModelConfig

    def piece(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows `rows` and columns `cols` (None: all) of parameter `name`, a new tensor."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole parameter's shape."""
        raise NotImplementedError


def _select(tensor: Any, rows: slice | None, cols: slice | None) -> Any:
    """tensor[rows, cols] for a matrix, tensor[rows] for a vector (a safetensors slice or a tensor)."""
    rows = rows or slice(None)
    return tensor[rows] if cols is None else tensor[rows, cols]


class CheckpointWeights(Weights):
    """A checkpoint folder's safetensors, opened lazily (a worker process receives this object
    pickled, and opens the files itself): only the slices asked for are read."""

    def __init__(self, folder: Path, config: ModelConfig):
        self.folder, self.config = folder, config
        self.files = self._weight_map(folder)
        self._open: dict[str, Any] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}

    @staticmethod
    def _weight_map(folder: Path) -> dict[str, str]:
        """Each tensor's file, by its name in the checkpoint ("model.layers.0...")."""
        index = folder / "model.safetensors.index.json"
        if index.exists():  # sharded checkpoint: the index maps each tensor to its file
            return dict(json.loads(index.read_text())["weight_map"])
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {str(folder)!r}")
        names = {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                names.update(dict.fromkeys(f.keys(), file.name))
        return names

    def _stored_name(self, name: str) -> str:
        # Hugging Face nests the decoder under "model." (model.layers.0...); the head sits outside.
        if name == "lm_head.weight":
            return "model.embed_tokens.weight" if self.config.tie_word_embeddings else name
        return name if name in self.files else f"model.{name}"

    def _slice(self, name: str) -> Any:
        stored = self._stored_name(name)
        if stored not in self.files:
            raise ValueError(f"checkpoint {str(self.folder)!r} does not match the model: no tensor {stored!r}")
        file = self.files[stored]
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), "pt", device="cpu")
        return self._open[file].get_slice(stored)

    def piece(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        return _select(self._slice(name), rows, cols)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def check(self, expected: list[str]) -> None:
        """ValueError unless the checkpoint holds exactly the tensors `expected` names (old
        checkpoints' saved RoPE frequencies aside)."""
        stored = {self._stored_name(n) for n in expected}
        missing = sorted(stored - set(self.files))
        unexpected = sorted(n for n in set(self.files) - stored - {"lm_head.weight"} if "rotary_emb" not in n)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


class StateWeights(Weights):
    """An in-memory transformers model's state dict (already whole in memory)."""

    def __init__(self, state: dict[str, torch.Tensor], config: ModelConfig):
        self.state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
        if config.tie_word_embeddings:
            self.state["lm_head.weight"] = self.state["embed_tokens.weight"]
        self.config = config

    def piece(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"the model's state dict does not match: no tensor {name!r}")
        return _select(self.state[name], rows, cols).clone()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)


class RandomWeights(Weights):
    """Random weights like transformers' init (N(0, std) matrices, zero biases, unit norms),
    each block of RANDOM_ROWS rows drawn from a generator seeded by (name, block): the values do
    not depend on which rows are asked for or on the number of ranks. `device` is where they are
    drawn: a GPU draws a 0.6B model in well under a second where a CPU takes seconds (single-
    threaded), but its generator gives other values than the CPU's, an equally random model."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu"):
        self.config = config
        self.draw_on = torch.device(device).type  # "cuda": each rank draws on its own GPU, the same values
        with torch.device("meta"):
            self.shapes = {n: tuple(p.shape) for n, p in Decoder(config).named_parameters(remove_duplicate=False)}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def piece(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            name = "embed_tokens.weight"
        shape = self.shapes[name]
        start, stop, _ = (rows or slice(None)).indices(shape[0])
        if len(shape) == 1 or name.endswith("norm.weight") or "layernorm" in name or name.endswith("bias"):
            fill = 1.0 if not name.endswith("bias") else 0.0
            return _select(torch.full(shape, fill), slice(start, stop), cols)
        first, last = start // RANDOM_ROWS, -(-stop // RANDOM_ROWS)  # the blocks that cover the rows asked for
        base = zlib.crc32(name.encode()) << 24
        blocks = []
        for block in range(first, last):
            n = min(RANDOM_ROWS, shape[0] - block * RANDOM_ROWS)
            generator = torch.Generator(self.draw_on).manual_seed(base + block)
            values = torch.empty(n, shape[1], device=self.draw_on).normal_(0.0, self.config.init_std,
                                                                           generator=generator)
            blocks.append(values if cols is None else values[:, cols].clone())  # one block's columns, not the whole row
        return torch.cat(blocks)[start - first * RANDOM_ROWS:stop - first * RANDOM_ROWS]


def open_weights(source: Source = None, device: str | torch.device = "cpu") -> Weights:
    """The config and the weights of anything load_model accepts, nothing read yet but the config.
    device: where a bare config's random weights are drawn (RandomWeights); read weights come to
    the CPU first, whatever it says."""
    if source is None:
        source = DEFAULT_MODEL
    if isinstance(source, torch.nn.Module):  # an in-memory transformers model
        config = config_from_hf(source.config)
        config.eos_token_ids = _generation_eos(source) or config.eos_token_ids
        return StateWeights(source.state_dict(), config)
    path = _resolve(source)
    if path.is_file():  # a bare config: real shape, random weights
        return RandomWeights(read_config(path), device)
    config = read_config(path / "config.json")
    config.eos_token_ids = _generation_eos(path) or config.eos_token_ids
    weights = CheckpointWeights(path, config)
    with torch.device("meta"):
        weights.check([n for n, _ in Decoder(config).named_parameters()])
    return weights
