"""The handful of numbers that define a Llama/Qwen-family decoder.

`loader.py` fills this from a Hugging Face config; `model.py` only reads it. Keeping our own
small dataclass (instead of passing transformers' config around) shows exactly which fields
the model depends on, and keeps model.py free of transformers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
