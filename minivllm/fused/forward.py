"""Chapter 9 — the same forward pass with its token-wise work fused (`LLM(..., fused_ops=True)`).

model.py stays plain PyTorch, one line per idea. `fused_forward` walks the same layers with
the same parameters and computes the same thing, but hands the token-wise parts to the small
Triton kernels of kernels.py: RMSNorm with the residual add in front of it, Qwen3's q/k
norm with RoPE, SiLU(gate)·up. Read it side by side with Decoder.forward and DecoderLayer.forward:

    Decoder.forward / DecoderLayer.forward      fused_forward
    x = embed(ids)                              x, residual = embed(ids), None
    cos, sin = rotary(positions)                cos_sin = the table, made once per model
    for each layer:                             for each layer:
        x = x + attn(norm_1(x))                     h, residual = norm_1(x + residual)
                                                    x = attn(h)
        x = x + mlp(norm_2(x))                      h, residual = norm_2(x + residual)
                                                    x = mlp(h)
    return norm(x)                              return norm(x + residual)

The residual stream is the same numbers in both columns; the fused column just adds each
sublayer's output to it at the start of the *next* norm, inside that norm's kernel, instead of
in a kernel of its own. (In the first layer there is nothing to add yet: residual is None.)

Two more savings live here rather than in a kernel:
- RoPE's cos and sin come from a table of every position the model can see, built once per
  model (`rope_cos_sin_table`, the chapter's exercise): the RoPE kernel reads one row per token
  instead of every forward computing [T, head_dim] angles, cosines and sines (seven kernels).
- `merge_projections(model)` (optional, once) lays each layer's q/k/v weights end to end in one
  tensor, and gate/up likewise, and makes the model's own parameters views into it: one GEMM
  instead of three (and two), no second copy of any weight, and model(...) is unchanged.

Nothing here reads a tensor's value on the host, so a forward can be captured in a CUDA graph.
The kernels need Triton: `check_fused_ops` says clearly when they cannot run.
"""
from __future__ import annotations

import weakref
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model import MLP, Attention, Decoder, SelfAttention
from minivllm.triton_support import import_kernels

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fused_ops(device: torch.device | str, dtype: torch.dtype) -> ModuleType:
    """The fused kernels (minivllm.fused.kernels) if Triton can run them on `dtype` tensors on
    `device`; otherwise a RuntimeError that says what to do. The engine calls it before it
    allocates anything, so that fused_ops=True fails at once where it cannot work."""
    if dtype not in FUSED_DTYPES:
        raise ValueError(f"fused ops run in float32, bfloat16 or float16, not {dtype}")
    return import_kernels("minivllm.fused.kernels", "fused_ops=True", "fused_ops=False (the default on the CPU)",
                          torch.device(device), dtype)


# ------------------------------------------------------------------------------------------
# RoPE's cos/sin table: the exercise
# ------------------------------------------------------------------------------------------


def rope_cos_sin_table(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """The cos and sin of every rotation angle RoPE can use, one row per position.

    inv_freq: [D/2] float32, the rotation frequency of each pair of dimensions (a model's
    `model.rotary.inv_freq`, Llama 3's scaled frequencies included); the table is built on its
    device. max_positions: how many positions (rows), an int >= 1. dtype: the model's dtype.

    Returns a new [max_positions, D] tensor of `dtype` on inv_freq's device whose row p is
    [cos(p * inv_freq), sin(p * inv_freq)] (D/2 cosines, then D/2 sines). The angles are
    computed in float32 as p * inv_freq, then cos and sin are taken in float32 and rounded to
    `dtype`: exactly what model.RotaryEmbedding.forward computes for position p, so row p
    equals, bit for bit, the first D/2 columns of its cos and of its sin.

    Raises ValueError if max_positions is not an int >= 1, or inv_freq is not a 1-D float32
    tensor.
    """
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be an int >= 1, got {max_positions!r}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError("inv_freq must be a 1-D float32 tensor of rotation frequencies")
    # BEGIN SOLUTION
    positions = torch.arange(max_positions, device=inv_freq.device).float()
    angles = positions[:, None] * inv_freq[None, :]  # [max_positions, D/2], as RotaryEmbedding does
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
    # END SOLUTION


# One table per model, made on its first fused forward (or by calling cos_sin_table before
# capturing a CUDA graph): the key is weak, so the table goes when the model does.
_TABLES: weakref.WeakKeyDictionary[Decoder, torch.Tensor] = weakref.WeakKeyDictionary()


def cos_sin_table(model: Decoder) -> torch.Tensor:
    """The model's RoPE table [max_position_embeddings, head_dim] on its device and in its
    dtype, made once. Positions the engine runs are < max_model_len <= max_position_embeddings."""
    table = _TABLES.get(model)
    if table is None or table.device != model.device or table.dtype != model.dtype:
        inv_freq = model.rotary.inv_freq.to(model.device)
        table = rope_cos_sin_table(inv_freq, model.config.max_position_embeddings, model.dtype)
        _TABLES[model] = table
    return table


# ------------------------------------------------------------------------------------------
# Merged projections: one GEMM for q/k/v and one for gate/up, without a second copy
# ------------------------------------------------------------------------------------------

# Per merged module (a SelfAttention or an MLP): the merged weight and bias, and where each of
# its parameters must still point for the merge to hold.
_MERGED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _merge(module: nn.Module, names: tuple[str, ...]) -> None:
    linears = [getattr(module, name) for name in names]
    if _merged(module, linears) is not None:  # merged already (a second engine on the same model)
        return
    weight = torch.cat([linear.weight for linear in linears])  # [sum of outputs, in]
    has_bias = linears[0].bias is not None
    bias = torch.cat([linear.bias for linear in linears]) if has_bias else None
    start = 0
    for linear in linears:
        end = start + linear.out_features
        # The parameter becomes rows start:end of the merged tensor; the old tensor is freed.
        linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if has_bias:
            linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    _MERGED[module] = (weight, bias, _pointers(linears))


def _pointers(linears: list[nn.Linear]) -> list[int]:
    return [p.data_ptr() for linear in linears for p in (linear.weight, linear.bias) if p is not None]


def merge_projections(model: Decoder) -> None:
    """Make each layer's q_proj/k_proj/v_proj weights (and biases) consecutive rows of one
    tensor, and gate_proj/up_proj likewise, so fused_forward runs one GEMM per group. The
    model's parameters become views of the merged tensors: model(...) computes exactly what it
    did, and no weight is stored twice (while merging, one layer's group exists twice at once).
    Moving the model afterwards (model.to(...)) undoes the merge; fused_forward notices and
    runs the separate GEMMs, so it is never wrong, only slower."""
    for layer in model.layers:
        _merge(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        _merge(layer.mlp, ("gate_proj", "up_proj"))


def _merged(module: nn.Module, linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The merged (weight, bias) of `module` if its parameters are still views of them."""
    merged = _MERGED.get(module)
    if merged is None:
        return None
    if _pointers(linears) != merged[2]:  # a parameter was replaced or moved: the merge no longer holds
        del _MERGED[module]  # and its tensors would only keep the old weights alive
        return None
    return merged[0], merged[1]


# ------------------------------------------------------------------------------------------
# The forward pass
# ------------------------------------------------------------------------------------------


def _self_attention(kernels: ModuleType, attn: SelfAttention, h: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, attention: Attention) -> torch.Tensor:
    """SelfAttention.forward with q/k norm and RoPE in one kernel (and q/k/v in one GEMM if merged)."""
    T = h.shape[0]
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    merged = _merged(attn, [attn.q_proj, attn.k_proj, attn.v_proj])
    if merged is not None:
        q, k, v = F.linear(h, *merged).split([q_size, kv_size, kv_size], dim=-1)  # views: strided rows
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    q = q.view(T, attn.num_heads, attn.head_dim)
    k = k.view(T, attn.num_kv_heads, attn.head_dim)
    v = v.view(T, attn.num_kv_heads, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q, k = kernels.qk_norm_rope(q, k, positions, cos_sin, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
    else:
        q, k = kernels.qk_norm_rope(q, k, positions, cos_sin)
    out = attention(attn.layer_idx, q, k, v)  # the one place where tokens interact
    return attn.o_proj(out.reshape(T, q_size))


def _mlp(kernels: ModuleType, mlp: MLP, h: torch.Tensor) -> torch.Tensor:
    """MLP.forward with SiLU·mul in one kernel (and gate/up in one GEMM if merged)."""
    merged = _merged(mlp, [mlp.gate_proj, mlp.up_proj])
    if merged is not None:
        gate, up = F.linear(h, *merged).chunk(2, dim=-1)
    else:
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
    return mlp.down_proj(kernels.silu_mul(gate, up))


def fused_forward(model: Decoder, input_ids: torch.Tensor, positions: torch.Tensor,
                  attention: Attention) -> torch.Tensor:
    """Decoder.forward with fused token-wise kernels: input_ids, positions [T] (a flat run of
    tokens from any number of sequences; every position < max_position_embeddings) -> the final
    normed hidden states [T, hidden]. Same parameters, same attention calls, same math."""
    kernels = check_fused_ops(model.device, model.dtype)
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(f"input_ids and positions must both be [T], got {tuple(input_ids.shape)} "
                         f"and {tuple(positions.shape)}")
    cos_sin = cos_sin_table(model)
    x, residual = model.embed_tokens(input_ids), None
    for layer in model.layers:
        norm_1, norm_2 = layer.input_layernorm, layer.post_attention_layernorm
        h, residual = kernels.rms_norm(x, norm_1.weight, norm_1.eps, residual)  # layer 0: residual = x
        x = _self_attention(kernels, layer.self_attn, h, positions, cos_sin, attention)
        h, residual = kernels.rms_norm(x, norm_2.weight, norm_2.eps, residual)
        x = _mlp(kernels, layer.mlp, h)
    return kernels.rms_norm(x, model.norm.weight, model.norm.eps, residual)[0]
