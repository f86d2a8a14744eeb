"""Chapter 14 — rank r's shard of a Decoder: the same model, each large matrix cut in N.

Read it beside model.py. A shard is a Decoder, with the same DecoderLayer, SelfAttention and MLP
classes and the same forward; `shard_decoder` swaps in the pieces of the right-hand column
(layers.py) and sets each attention's head counts to its share:

    model.py, one process                  rank r of N
    embed_tokens    Embedding [V, h]       VocabParallelEmbedding [ceil(V/N), h]       + all-reduce
    q_proj          h -> H·d               column-parallel: h -> (H/N)·d, its H/N heads
    k_proj, v_proj  h -> Hkv·d             column-parallel: h -> (Hkv/N)·d; when N > Hkv, one KV head,
                                           the same on the N/Hkv ranks whose query heads read it
    attention       H heads over Hkv       H/N heads over its own KV heads, in a KV pool of its own
    o_proj          H·d -> h               row-parallel: (H/N)·d -> h                  + all-reduce
    gate, up_proj   h -> I                 column-parallel: h -> I/N
    down_proj       I -> h                 row-parallel: I/N -> h                      + all-reduce
    norms, RoPE     over h, over d         the same on every rank (each holds the whole x)
    lm_head         h -> V                 ParallelLMHead: h -> ceil(V/N), gathered on rank 0

So a layer costs two all-reduces of [T, h]; the embedding one more, and the logits a gather.
That is the whole price of tensor parallelism, and what the chapter's cost model prices.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from minivllm.distributed.layers import (
    Communicator,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel,
    row_parallel,
    vocab_shard,
)
from minivllm.model import Decoder, ModelConfig, RotaryEmbedding


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """ValueError unless `world_size` ranks can split this model: N divides the attention heads
    and the MLP's width, and the KV heads split evenly (N divides them) or are replicated evenly
    (they divide N, so each KV head serves the query heads of N/Hkv ranks)."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {heads} attention heads")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {kv_heads} KV heads, or be a "
                         f"multiple of them (then each KV head is replicated on {world_size}/{kv_heads} ranks)")
    if config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the MLP's width "
                         f"(intermediate_size={config.intermediate_size})")


def kv_split(config: ModelConfig, rank: int, world_size: int) -> tuple[int, int]:
    """(part, parts) to cut k_proj and v_proj with, for rank `rank`: the KV heads split like the
    query heads when N divides them; otherwise in one part per KV head, rank r taking the part
    its query heads read, r // (N / Hkv) (N/Hkv ranks hold each KV head)."""
    kv_heads = config.num_kv_heads
    if kv_heads % world_size == 0:
        return rank, world_size
    return rank // (world_size // kv_heads), kv_heads


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's shape: its query heads, KV heads and MLP width (the KV pool is sized from
    these). The vocabulary stays the model's: the LM head gathers whole rows of logits."""
    check_shardable(config, world_size)
    return dataclasses.replace(config, num_heads=config.num_heads // world_size,
                               num_kv_heads=max(1, config.num_kv_heads // world_size),
                               intermediate_size=config.intermediate_size // world_size)


def _copy(module: nn.Module, device: torch.device) -> nn.Module:
    """A module every rank holds whole (a norm): its own copy."""
    return copy.deepcopy(module).to(device)


@torch.no_grad()
def shard_decoder(model: Decoder, comm: Communicator, device: torch.device | str | None = None) -> Decoder:
    """Rank comm.rank's shard of `model` for comm.world_size ranks, a new Decoder on `device`
    (default: the model's) whose collectives go through `comm`. `model` is left as it was."""
    rank, n = comm.rank, comm.world_size
    cfg, device = model.config, torch.device(device or model.device)
    with torch.device("meta"):  # the skeleton costs no memory: every parameter is replaced below
        shard = Decoder(shard_config(cfg, n))
    shard.embed_tokens = VocabParallelEmbedding(vocab_shard(model.embed_tokens.weight, rank, n).to(device), rank, comm)
    head = shard.embed_tokens.weight if cfg.tie_word_embeddings else nn.Parameter(
        vocab_shard(model.lm_head.weight, rank, n).to(device), requires_grad=False)
    shard.lm_head = ParallelLMHead(head, cfg.vocab_size, comm)
    shard.rotary = RotaryEmbedding(cfg)
    shard.norm = _copy(model.norm, device)
    kv_part, kv_parts = kv_split(cfg, rank, n)
    for full, layer in zip(model.layers, shard.layers):
        layer.input_layernorm = _copy(full.input_layernorm, device)
        layer.post_attention_layernorm = _copy(full.post_attention_layernorm, device)
        attn, full_attn = layer.self_attn, full.self_attn  # attn's head counts are its share already
        attn.q_proj = column_parallel(full_attn.q_proj, rank, n).to(device)
        attn.k_proj = column_parallel(full_attn.k_proj, kv_part, kv_parts).to(device)
        attn.v_proj = column_parallel(full_attn.v_proj, kv_part, kv_parts).to(device)
        attn.o_proj = RowParallelLinear(row_parallel(full_attn.o_proj, rank, n).to(device), comm)
        if hasattr(full_attn, "q_norm"):
            attn.q_norm, attn.k_norm = _copy(full_attn.q_norm, device), _copy(full_attn.k_norm, device)
        mlp, full_mlp = layer.mlp, full.mlp
        mlp.gate_proj = column_parallel(full_mlp.gate_proj, rank, n).to(device)
        mlp.up_proj = column_parallel(full_mlp.up_proj, rank, n).to(device)
        mlp.down_proj = RowParallelLinear(row_parallel(full_mlp.down_proj, rank, n).to(device), comm)
    left = [name for name, p in shard.named_parameters() if p.is_meta]
    if left:
        raise AssertionError(f"shard_decoder left parameters unset: {left}")
    return shard.eval().requires_grad_(False)
