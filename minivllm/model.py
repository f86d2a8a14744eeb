"""One decoder for the Llama, Qwen2 and Qwen3 families.

The forward pass runs on a *flat* list of tokens: `input_ids` [T] and `positions` [T], with no
batch axis. Every operation in this file is token-wise (each row of [T, hidden] is transformed
on its own), except one call per layer:

    out = attention(layer_idx, q, k, v)

That is the only place where tokens meet. Each chapter of the course passes a different
`attention` object (a causal mask, a KV cache, a padded batch, a block-diagonal mask, a paged
cache, a Triton kernel) and this file never changes.

Parameter names follow Hugging Face's (`embed_tokens`, `layers.N.self_attn.q_proj`, ...), so a
checkpoint's state dict loads directly (see loader.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


# The handful of numbers that define a decoder. loader.py fills it from a Hugging Face config;
# this file only reads it: the fields below are exactly what the model depends on, and the
# model stays free of transformers.
@dataclass
class ModelConfig:
    model_type: str  # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads // num_kv_heads query heads share one (GQA)
    head_dim: int  # not always hidden_size // num_heads (Qwen3-0.6B: 1024 hidden, 16 heads, 128 head_dim)
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    rope_scaling: dict = field(default_factory=dict)  # the llama3 frequency-scaling parameters
    qkv_bias: bool = False  # Qwen2 adds a bias to q, k and v
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 RMS-normalises each head of q and k before RoPE
    tie_word_embeddings: bool = False  # the LM head reuses the embedding matrix
    init_std: float = 0.02  # for random weights (config-only sources)
    eos_token_ids: list[int] = field(default_factory=list)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of KV cache one token costs: K and V, in every layer, for every KV head."""
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def num_parameters(self) -> int:
        """Parameter count, computed from the shapes (no weights needed)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * self.intermediate_size + ((2 * self.intermediate_size + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h  # + the two RMSNorm weights
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


class Attention(Protocol):
    """How one layer's queries meet the keys and values of the past.

    q: [T, num_heads, head_dim], k and v: [T, num_kv_heads, head_dim] for the T tokens of this
    forward pass (RoPE already applied). Returns [T, num_heads, head_dim].
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even when the model runs in bf16: the mean of squares overflows
        # and loses precision in 16-bit floats.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The rotation frequency of each pair of dimensions: theta^(-2i/d), i = 0 .. d/2-1."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_type == "default":
        return inv_freq
    # Llama 3 stretches the long wavelengths (low frequencies) by `factor` so that the model
    # reaches a longer context, keeps the short ones, and blends smoothly in between.
    s = config.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: rotates each (x_i, x_{i+d/2}) pair by position * freq_i."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: `model.to(torch.bfloat16)` must not round the
        # frequencies, or positions in the thousands rotate by visibly wrong angles.
        self.inv_freq = rope_inv_freq(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token: [T, 1, head_dim] each (broadcast over heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, d]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)  # the one place where tokens interact
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The whole model. `forward` returns the final hidden states [T, hidden];
    `lm_head(hidden)` turns the rows you need into logits (usually one row per sequence)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """input_ids, positions: [T] (a flat run of tokens from any number of sequences)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)  # computed once, shared by every layer
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)
