"""Chapter 14 — each rank reads only its shard: no process ever holds the whole model.

shard.py cuts a shard out of a whole Decoder, which is simple to read but means rank 0 first
holds all the weights (at 2 ranks, 1.5x the weights in one process). Tensor parallelism is for
models that do not fit one device, so here each rank asks the checkpoint (loader.Weights) for
its own slices only, the same cuts as shard.py's:

    column-parallel  q/k/v, gate/up     rows  r*k .. (r+1)*k of the weight (and of the bias)
    row-parallel     o_proj, down_proj  columns r*k .. (r+1)*k (the bias on rank 0 only)
    vocabulary       embed, lm_head     rows r*ceil(V/N) .. , zero-padded past V
    replicated       norms              whole

From a safetensors file a slice is read without the rest (`get_slice`); a config-only model's
random weights are drawn per block of rows from seeds of their own (loader.RandomWeights), so
every N builds the same model.

The price: a row-parallel slice is a strided read (part of every row), and the checkpoint's files
are opened by every rank (the operating system's page cache holds them once).
"""
from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.layers import (
    Communicator,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_rows,
)
from minivllm.distributed.shard import kv_split, shard_config
from minivllm.loader import Weights, default_device, default_dtype, open_weights
from minivllm.model import Decoder, RotaryEmbedding


class UnloadedDecoder(Decoder):
    """A model's shape, device, dtype and where its weights are, with no weights (on "meta"):
    what rank 0's engine holds when every rank loads its own shard. It cannot run."""

    def __init__(self, weights: Weights, device: torch.device, dtype: torch.dtype):
        with torch.device("meta"):
            super().__init__(weights.config)
        self.weights, self._device, self._dtype = weights, torch.device(device), dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def __reduce__(self) -> tuple:  # to a spawned rank: where the weights are, not the empty skeleton
        return UnloadedDecoder, (self.weights, self._device, self._dtype)

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model's weights were never loaded: each tensor-parallel rank loads its own shard")


def unloaded_model(source, device: str | None = None, dtype: torch.dtype | None = None) -> UnloadedDecoder:
    """The model `source` names (anything load_model accepts), its weights left where they are."""
    device = device or default_device()
    return UnloadedDecoder(open_weights(source, device), device, dtype or default_dtype(device))


def _param(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = _param(weight, device, dtype)
    if bias is not None:
        layer.bias = _param(bias, device, dtype)
    return layer


@torch.no_grad()
def load_shard(weights: Weights, comm: Communicator, device: torch.device | str,
               dtype: torch.dtype) -> Decoder:
    """Rank comm.rank's shard of the model for comm.world_size ranks, read from `weights` piece by
    piece: the same Decoder shard.shard_decoder cuts from the whole model, never holding it."""
    rank, n, cfg, device = comm.rank, comm.world_size, weights.config, torch.device(device)
    piece = weights.piece

    def maybe(has_bias: bool, name: str, rows: slice | None = None) -> torch.Tensor | None:
        return piece(name, rows) if has_bias else None

    def vocab(name: str) -> torch.Tensor:  # rows r*k .. (r+1)*k, zero rows past V
        k = vocab_rows(cfg.vocab_size, n)
        start, stop = min(rank * k, cfg.vocab_size), min((rank + 1) * k, cfg.vocab_size)
        shard = torch.zeros(k, cfg.hidden_size)
        if stop > start:
            shard[:stop - start] = piece(name, slice(start, stop))
        return shard

    def rows(size: int, part: int, parts: int) -> slice:
        k = size // parts
        return slice(part * k, (part + 1) * k)

    with torch.device("meta"):
        shard = Decoder(shard_config(cfg, n))
    shard.rotary = RotaryEmbedding(cfg)
    shard.embed_tokens = VocabParallelEmbedding(vocab("embed_tokens.weight").to(device, dtype), rank, comm)
    head = shard.embed_tokens.weight if cfg.tie_word_embeddings else _param(vocab("lm_head.weight"), device, dtype)
    shard.lm_head = ParallelLMHead(head, cfg.vocab_size, comm)
    shard.norm.weight = _param(piece("norm.weight"), device, dtype)
    kv_part, kv_parts = kv_split(cfg, rank, n)
    q_size, kv_size, width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i, layer in enumerate(shard.layers):
        p = f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, norm).weight = _param(piece(p + norm + ".weight"), device, dtype)
        attn = layer.self_attn
        for proj, (part, parts, size) in {"q_proj": (rank, n, q_size), "k_proj": (kv_part, kv_parts, kv_size),
                                          "v_proj": (kv_part, kv_parts, kv_size)}.items():
            name, cut = p + "self_attn." + proj, rows(size, part, parts)
            setattr(attn, proj, _linear(piece(name + ".weight", cut), maybe(cfg.qkv_bias, name + ".bias", cut), device, dtype))
        name, cols = p + "self_attn.o_proj", rows(q_size, rank, n)
        bias = maybe(cfg.o_bias and rank == 0, name + ".bias")  # added once, by rank 0
        attn.o_proj = RowParallelLinear(_linear(piece(name + ".weight", None, cols), bias, device, dtype), comm)
        if cfg.qk_norm:
            attn.q_norm.weight = _param(piece(p + "self_attn.q_norm.weight"), device, dtype)
            attn.k_norm.weight = _param(piece(p + "self_attn.k_norm.weight"), device, dtype)
        mlp = layer.mlp
        for proj in ("gate_proj", "up_proj"):
            name, cut = p + "mlp." + proj, rows(width, rank, n)
            setattr(mlp, proj, _linear(piece(name + ".weight", cut), maybe(cfg.mlp_bias, name + ".bias", cut), device, dtype))
        name = p + "mlp.down_proj"
        bias = maybe(cfg.mlp_bias and rank == 0, name + ".bias")
        mlp.down_proj = RowParallelLinear(_linear(piece(name + ".weight", None, rows(width, rank, n)), bias,
                                                  device, dtype), comm)
    left = [name for name, param in shard.named_parameters() if param.is_meta]
    if left:
        raise AssertionError(f"load_shard left parameters unset: {left}")
    return shard.eval().requires_grad_(False)

