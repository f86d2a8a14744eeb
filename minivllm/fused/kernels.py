"""Chapter 9 — the token-wise work of a layer in four small Triton kernels.

Everything in model.py except attention and the matmuls is token-wise and tiny: a decode row
of Qwen3-0.6B is 1,024 numbers. Eager PyTorch runs each line of RMSNorm or RoPE as its own
kernel, and each kernel reads its input from memory and writes its output back. Counted with
torch.profiler on the Qwen3-0.6B shape in bf16, one layer is 53 operations: 7 matmuls and 46
small elementwise kernels and reductions (float casts, squares, means, rsqrt, multiplies,
concatenations, negations, adds). Replayed from a CUDA graph those still cost a few
microseconds each, more than the arithmetic they do. The kernels here do the same math in
one pass per step, each row read once and written once:

    rms_norm            x -> weight * rmsnorm(x)                             [T, hidden]
                        (optionally adding a residual first, and returning the sum:
                        the residual stream is threaded through the layers as in vLLM)
    qk_norm_rope        q, k -> RoPE(q_norm(q)), RoPE(k_norm(k))             [T, heads, head_dim]
                        (Qwen3's per-head RMSNorm, or none for Llama and Qwen2)
    silu_mul            gate, up -> silu(gate) * up                          [T, intermediate]

One layer becomes 11 launches (plus attention): rms_norm, three projections, qk_norm_rope,
o_proj, rms_norm with the residual, gate and up projections, silu_mul, down projection.

Memory traffic saved, per token and layer, counted in rows of the tensor each op touches:
- residual add + RMSNorm. Eager: the add (read 2 rows, write 1), the cast to fp32 (read 1,
  write 2: fp32 is twice as wide as bf16), the square, the mean, the multiply by rstd, the
  cast back and the multiply by the weight each read and write a row again: about 16 bf16
  rows of traffic. Fused: read x and the residual, write the normed row and the new residual:
  4 rows (the weight stays in the L2 cache across rows).
- q/k norm + RoPE. Eager: the same RMSNorm sequence on q and on k, then rotate-half builds a
  negated copy and a concatenation, two products and a sum: about 25 rows of q and of k each.
  Fused: read q and k once, write them once; cos and sin are one row of a table.
- SiLU·mul. Eager: silu reads gate and writes it back, the multiply reads both and writes the
  result: 5 rows of [intermediate]. Fused: 3.

Numerics are model.py's, operation for operation: RMSNorm in fp32, cast back to the model's
dtype before the weight multiplies it; the residual sum rounded to the model's dtype (as
`x + attn(...)` is); cos and sin in the model's dtype; every product and sum of RoPE rounded
where PyTorch rounds it (each bf16 op computes in fp32 and rounds once, so doing the same
here gives the same bits up to the order of the mean's additions and rsqrt's last ulp).

Every launch is sized by shapes alone (no value is read back to the host), so a whole forward
can be captured in a CUDA graph.

Triton is imported at the top: import this module through minivllm.fused.check_fused_ops,
which refuses clearly where Triton cannot run. Kernels are compiled for the GPU unless
TRITON_INTERPRET=1 was set before this module was imported (then they run on the CPU in
Triton's interpreter, which cannot compute in bfloat16; see INTERPRETED).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.triton_support import built_for_interpreter


def _num_warps(block: int) -> int:
    """Warps for a program that holds `block` elements: about 8 elements per thread."""
    return max(1, min(16, block // 256))


def _check_rows(name: str, x: torch.Tensor, width: int) -> None:
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{name} must be [T, {width}] with contiguous rows, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")


# ------------------------------------------------------------------------------------------
# 1. RMSNorm, with or without the residual add in front of it
# ------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, eps,
    stride_x, stride_residual, stride_out, stride_new_residual,
    N: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    # One program per row: the whole row of N numbers sits in registers (BLOCK >= N, a power
    # of two), so the sum of squares and the normalisation read memory once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # model.py's `x = x + sublayer(x)`: the sum is rounded to the model's dtype, then both
        # carried on (as the residual) and normalised.
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)  # padding columns are 0: they add nothing
    normed = (x32 * rstd).to(x.dtype)  # cast back before the weight, like RMSNorm.forward
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of x [T, N] (or of x + residual): returns (normed [T, N], the row
    that was normalised [T, N]). Without a residual the second is x itself; with one it is the
    new residual x + residual, which the next layer adds its own output to."""
    T, N = x.shape
    _check_rows("x", x, N)
    if weight.shape != (N,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{N}] vector, got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    new_residual = x
    if residual is not None:
        _check_rows("residual", residual, N)
        new_residual = torch.empty_like(x)
    source = x if residual is None else residual  # unused pointer when there is no residual
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(T,)](
        x, source, weight, out, new_residual, eps,
        x.stride(0), source.stride(0), out.stride(0), new_residual.stride(0),
        N=N, BLOCK=block, ADD_RESIDUAL=residual is not None, num_warps=_num_warps(block),
    )
    return out, new_residual


# ------------------------------------------------------------------------------------------
# 2. Qwen3's q/k RMSNorm fused with RoPE (or RoPE alone)
# ------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope_heads(
    x_ptr, out_ptr, weight_ptr, cos, sin, eps, stride_x_head, stride_out_head,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """All heads of one token: x [NUM_HEADS, 2 * HALF] -> out, normalised per head (if
    HAS_NORM) and rotated. cos, sin: [1, BLOCK_HALF] fp32 rows (the token's position)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    # Rotate-half pairs dimension i with i + HALF, so each head is loaded as its two halves.
    first = x_ptr + heads * stride_x_head + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]  # [BLOCK_H, 1]
        w1 = tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (b * rstd).to(dtype).to(tl.float32)).to(dtype)
    # apply_rope: x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; each product
    # and the sum rounded to the model's dtype, as PyTorch does in x * cos + rotated * sin.
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (a * cos).to(dtype).to(tl.float32) + (-b * sin).to(dtype).to(tl.float32)
    out2 = (b * cos).to(dtype).to(tl.float32) + (a * sin).to(dtype).to(tl.float32)
    first_out = out_ptr + heads * stride_out_head + dims
    tl.store(first_out, out1.to(dtype), mask=mask)
    tl.store(first_out + HALF, out2.to(dtype), mask=mask)


# positions_ptr is a view into the step's packed inputs (worker/prepare.py), at an offset that moves
# with the step's number of tokens: not specialised on its alignment, so a step compiles nothing new.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr, eps,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_q_out_token, stride_q_out_head, stride_k_out_token, stride_k_out_head, stride_table,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    # One program per token: its position picks one row of the cos/sin table, which serves all
    # of its query and key heads.
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + position * stride_table + dims  # table row: [cos (HALF) | sin (HALF)]
    cos = tl.load(row, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=dims < HALF, other=0.0).to(tl.float32)
    _norm_rope_heads(q_ptr + token * stride_q_token, q_out_ptr + token * stride_q_out_token, q_weight_ptr,
                     cos, sin, eps, stride_q_head, stride_q_out_head,
                     NUM_Q_HEADS, HALF, BLOCK_Q, BLOCK_HALF, HAS_NORM)
    _norm_rope_heads(k_ptr + token * stride_k_token, k_out_ptr + token * stride_k_out_token, k_weight_ptr,
                     cos, sin, eps, stride_k_head, stride_k_out_head,
                     NUM_KV_HEADS, HALF, BLOCK_KV, BLOCK_HALF, HAS_NORM)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, Hq, D] and k [T, Hkv, D] (each head RMS-normalised first when q_weight
    and k_weight [D] are given, as in Qwen3). positions [T]; cos_sin [max_positions, D], the
    table of minivllm.fused.rope_cos_sin_table (cos of row p in its first D/2 columns, sin in
    the rest). Every position must be < max_positions: a kernel cannot check that without
    making the host wait for the GPU. Returns new contiguous q and k."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if D % 2 or k.shape != (T, Hkv, D) or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q [T, Hq, D] and k [T, Hkv, D] need the same T and an even, contiguous D; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    if positions.shape != (T,) or cos_sin.dim() != 2 or cos_sin.shape[1] != D or cos_sin.stride(1) != 1:
        raise ValueError(f"positions must be [{T}] and cos_sin [max_positions, {D}], got "
                         f"{tuple(positions.shape)} and {tuple(cos_sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight come together (Qwen3) or not at all")
    has_norm = q_weight is not None
    if has_norm and (q_weight.shape != (D,) or k_weight.shape != (D,)):
        raise ValueError(f"q_weight and k_weight must be [{D}]")
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hkv, D, dtype=k.dtype, device=k.device)
    half = D // 2
    block_half = triton.next_power_of_2(half)
    _qk_norm_rope_kernel[(T,)](
        q, k, q_out, k_out, q_weight if has_norm else q, k_weight if has_norm else k, positions, cos_sin, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
        NUM_Q_HEADS=Hq, NUM_KV_HEADS=Hkv, HALF=half, BLOCK_Q=triton.next_power_of_2(Hq),
        BLOCK_KV=triton.next_power_of_2(Hkv), BLOCK_HALF=block_half, HAS_NORM=has_norm,
        num_warps=_num_warps(triton.next_power_of_2(Hq) * block_half),
    )
    return q_out, k_out


# ------------------------------------------------------------------------------------------
# 3. SiLU(gate) * up
# ------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, N, BLOCK: tl.constexpr):
    # Program (row, column block): BLOCK columns of one row. Rows of the MLP are wide (3,072
    # for Qwen3-0.6B, 8,192 for Llama-3.2-1B), so a row is split over several programs.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded to the model's dtype
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate, up [T, N] (rows may be strided, e.g. the two halves of one
    merged projection). Returns a new [T, N] tensor."""
    T, N = gate.shape
    _check_rows("gate", gate, N)
    _check_rows("up", up, N)
    if up.shape[0] != T:
        raise ValueError(f"gate and up must have the same rows, got {T} and {up.shape[0]}")
    out = torch.empty(T, N, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), N, BLOCK=block, num_warps=4,
    )
    return out


# Whether Triton built the kernels above for its CPU interpreter (TRITON_INTERPRET=1 at import
# time) rather than for a GPU: interpreted kernels run on CPU tensors, compiled ones need CUDA.
# (A RuntimeError here if Triton's own library was built for the other: the variable came too late.)
INTERPRETED = built_for_interpreter(_rms_norm_kernel)
