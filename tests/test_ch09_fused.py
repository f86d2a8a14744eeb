"""Chapter 9: the fused token-wise kernels, on the CPU in Triton's interpreter.

Each kernel is checked against the plain-PyTorch code of model.py it replaces (RMSNorm,
RotaryEmbedding + apply_rope, SiLU·mul) on odd shapes: widths that are not powers of two,
1 and 37 tokens, grouped-query heads, head_dim 32, 64 and 80, Llama 3's scaled frequencies,
rows that are strided views of a merged projection. Then `fused_forward` against `model(...)`
for every tiny family, the merged projections, and the engine with fused_ops=True against
transformers' greedy tokens. bf16 is left to the GPU (the interpreter cannot compute in it).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_prompts, unspecialised
from torch import nn

from minivllm.attention.dense import attend
from minivllm.attention.masks import causal_mask
from minivllm.model import ModelConfig
from minivllm.fused import check_fused_ops, fused_forward, merge_projections, rope_cos_sin_table
from minivllm.model import RMSNorm, RotaryEmbedding, apply_rope, rope_inv_freq

pytest.importorskip("triton")
pytestmark = [pytest.mark.ch09, pytest.mark.floors]

TIGHT = dict(atol=1e-5, rtol=1e-5)  # fp32: only the order of a sum's additions may differ
HALF = dict(atol=2e-3, rtol=2e-3)  # fp16: a last-bit difference in rsqrt or exp may flip a rounding


@pytest.fixture(scope="module")
def kernels(triton_interpreter):
    """The fused kernels, run by Triton's interpreter for this module's checks only (conftest.py)."""
    from minivllm.fused import kernels as fused_kernels

    assert fused_kernels.INTERPRETED, "minivllm.fused.kernels was not imported under TRITON_INTERPRET=1"
    return fused_kernels


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rope_config(head_dim: int, llama3: bool) -> ModelConfig:
    """A config that only RoPE reads: default frequencies, or Llama 3's scaled ones."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    return ModelConfig(model_type="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=head_dim, max_position_embeddings=512,
                       rope_theta=500000.0 if llama3 else 10000.0, rope_type="llama3" if llama3 else "default",
                       rope_scaling=scaling if llama3 else {})


# ------------------------------------------------------------------------------------------
# The kernels, one by one, against model.py's PyTorch
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T, hidden", [(1, 64), (37, 200), (5, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_model(kernels, T, hidden, with_residual):
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = randn(hidden, seed=1) + 1.0
    x = randn(T, hidden, seed=2, scale=3.0)
    residual = randn(T, hidden, seed=3) if with_residual else None
    out, new_residual = kernels.rms_norm(x, norm.weight, norm.eps, residual)
    expected_residual = x + residual if with_residual else x
    assert torch.equal(new_residual, expected_residual)  # the sum is one rounded add, as in model.py
    torch.testing.assert_close(out, norm(expected_residual), **TIGHT)


def test_rms_norm_in_float16_and_strided_rows(kernels):
    """fp16 rounds where model.py rounds; rows may be views with a longer stride."""
    norm = RMSNorm(96, eps=1e-5).half()
    norm.weight.data = randn(96, seed=4, dtype=torch.float16) + 1
    wide = randn(9, 150, seed=5, dtype=torch.float16)
    x, residual = wide[:, :96], randn(9, 96, seed=6, dtype=torch.float16)
    out, new_residual = kernels.rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual), **HALF)


# (tokens, query heads, kv heads, head_dim): one token, GQA 4:1 and 7:1 (padding in every
# dimension of the tile), head_dim 32, 64 and 80.
ROPE_SHAPES = [(1, 4, 2, 64), (37, 8, 2, 32), (6, 14, 2, 80)]


@pytest.mark.parametrize("T, heads, kv_heads, head_dim", ROPE_SHAPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("llama3", [False, True])
def test_qk_norm_rope_matches_model(kernels, T, heads, kv_heads, head_dim, qk_norm, llama3):
    config = rope_config(head_dim, llama3)
    rotary = RotaryEmbedding(config)
    table = rope_cos_sin_table(rotary.inv_freq, config.max_position_embeddings, torch.float32)
    positions = torch.randint(0, config.max_position_embeddings, (T,), generator=torch.Generator().manual_seed(T))
    # q and k as views of one merged projection [T, (heads + 2 kv_heads) * D]: strided rows.
    qkv = randn(T, (heads + 2 * kv_heads) * head_dim, seed=7, scale=2.0)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    q_norm.weight.data, k_norm.weight.data = randn(head_dim, seed=8) + 1, randn(head_dim, seed=9) + 1

    cos, sin = rotary(positions, torch.float32)
    eq, ek = (q_norm(q), k_norm(k)) if qk_norm else (q, k)
    expected_q, expected_k = apply_rope(eq, cos, sin), apply_rope(ek, cos, sin)
    weights = (q_norm.weight, k_norm.weight, 1e-6) if qk_norm else ()
    got_q, got_k = kernels.qk_norm_rope(q, k, positions, table, *weights)
    torch.testing.assert_close(got_q, expected_q, **TIGHT)
    torch.testing.assert_close(got_k, expected_k, **TIGHT)


def test_qk_norm_rope_in_float16(kernels):
    config = rope_config(64, llama3=False)
    rotary = RotaryEmbedding(config)
    table = rope_cos_sin_table(rotary.inv_freq, config.max_position_embeddings, torch.float16)
    positions = torch.tensor([0, 3, 100, 511])
    q, k = randn(4, 4, 64, seed=10, dtype=torch.float16), randn(4, 2, 64, seed=11, dtype=torch.float16)
    norm = RMSNorm(64, 1e-6).half()
    cos, sin = rotary(positions, torch.float16)
    got_q, got_k = kernels.qk_norm_rope(q, k, positions, table, norm.weight, norm.weight, 1e-6)
    torch.testing.assert_close(got_q, apply_rope(norm(q), cos, sin), **HALF)
    torch.testing.assert_close(got_k, apply_rope(norm(k), cos, sin), **HALF)


@pytest.mark.parametrize("T, width, dtype", [(1, 96, torch.float32), (37, 3000, torch.float32),
                                             (3, 1100, torch.float16)])
def test_silu_mul_matches_model(kernels, T, width, dtype):
    """Gate and up as the two halves of one merged projection (strided rows); 3,000 columns
    take three column blocks, the last one partial."""
    gate_up = randn(T, 2 * width, seed=12, dtype=dtype, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up, **(TIGHT if dtype == torch.float32 else HALF))


def test_positions_are_not_specialised_on(kernels):
    """positions is a view into the step's packed inputs, at an offset that moves with its
    number of tokens: specialising on its alignment would compile variants mid-run."""
    assert "positions_ptr" in unspecialised(kernels._qk_norm_rope_kernel)[1]


def test_kernels_refuse_bad_shapes(kernels):
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.rms_norm(x.t(), torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="even"):
        kernels.qk_norm_rope(torch.zeros(2, 2, 7), torch.zeros(2, 1, 7), torch.zeros(2, dtype=torch.long),
                             torch.zeros(4, 7))
    with pytest.raises(ValueError, match="together"):
        kernels.qk_norm_rope(torch.zeros(2, 2, 8), torch.zeros(2, 1, 8), torch.zeros(2, dtype=torch.long),
                             torch.zeros(4, 8), q_weight=torch.ones(8))
    with pytest.raises(ValueError, match="same rows"):
        kernels.silu_mul(torch.zeros(3, 8), torch.zeros(2, 8))


# ------------------------------------------------------------------------------------------
# The exercise: the cos/sin table
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("llama3", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cos_sin_table_equals_rotary_embedding(llama3, dtype):
    """Row p is, bit for bit, what RotaryEmbedding computes for position p (pure PyTorch: bf16
    is fine here), for default and Llama 3 frequencies, at the first and last positions."""
    config = rope_config(64, llama3)
    rotary = RotaryEmbedding(config)
    table = rope_cos_sin_table(rotary.inv_freq, 512, dtype)
    assert table.shape == (512, 64) and table.dtype == dtype
    positions = torch.tensor([0, 1, 2, 63, 64, 300, 511])
    cos, sin = rotary(positions, dtype)  # [T, 1, 64]: each half repeated
    assert torch.equal(table[positions], torch.cat([cos[:, 0, :32], sin[:, 0, :32]], dim=-1))


def test_cos_sin_table_refuses_bad_input():
    inv_freq = rope_inv_freq(rope_config(32, llama3=False))
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_positions"):
            rope_cos_sin_table(inv_freq, bad, torch.float32)
    for bad in (inv_freq.double(), inv_freq[None], [0.1, 0.2]):
        with pytest.raises(ValueError, match="inv_freq"):
            rope_cos_sin_table(bad, 8, torch.float32)


# ------------------------------------------------------------------------------------------
# The whole forward pass
# ------------------------------------------------------------------------------------------


def dense_causal(T: int):
    """Attention of T tokens of one sequence to each other: enough to compare two forwards."""
    mask = causal_mask(T)
    return lambda layer, q, k, v: attend(q, k, v, mask)


@pytest.mark.parametrize("T", [1, 37])
def test_fused_forward_matches_model(kernels, model, T):
    ids = torch.tensor(random_prompts([T], seed=T)[0])
    positions = torch.arange(T) + (200 if T == 1 else 0)  # a lone token far into its sequence
    with torch.inference_mode():
        expected = model(ids, positions, dense_causal(T))
        got = fused_forward(model, ids, positions, dense_causal(T))
    torch.testing.assert_close(got, expected, **TIGHT)


def test_merged_projections(kernels, qwen3_model):
    """After merge_projections the model's own parameters are views of one tensor per group:
    model(...) gives exactly what it gave, no weight is stored twice, fused_forward (one GEMM
    per group) matches; replacing one weight undoes the merge and fused_forward notices."""
    model = copy.deepcopy(qwen3_model)
    ids, positions = torch.tensor(random_prompts([11], seed=3)[0]), torch.arange(11)
    storage_bytes = lambda m: sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                                   for p in m.parameters()}.values())
    with torch.inference_mode():
        before, bytes_before = model(ids, positions, dense_causal(11)), storage_bytes(model)
        merge_projections(model)
        assert torch.equal(model(ids, positions, dense_causal(11)), before)
        assert storage_bytes(model) == bytes_before
        pointers = [p.data_ptr() for p in model.parameters()]
        merge_projections(model)  # a second engine on the same model: nothing moves
        assert [p.data_ptr() for p in model.parameters()] == pointers
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        assert len({p.untyped_storage().data_ptr() for p in (attn.q_proj.weight, attn.k_proj.weight,
                                                              attn.v_proj.weight)}) == 1
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
        torch.testing.assert_close(fused_forward(model, ids, positions, dense_causal(11)), before, **TIGHT)

        attn.k_proj.weight = nn.Parameter(attn.k_proj.weight + 1.0, requires_grad=False)  # no longer a view
        changed = model(ids, positions, dense_causal(11))
        assert not torch.equal(changed, before)
        torch.testing.assert_close(fused_forward(model, ids, positions, dense_causal(11)), changed, **TIGHT)


def test_refuses_where_triton_cannot(kernels, monkeypatch):
    assert check_fused_ops("cpu", torch.float32) is kernels
    with pytest.raises(RuntimeError, match="bfloat16"):
        check_fused_ops("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        check_fused_ops("cpu", torch.int64)
    monkeypatch.setattr(kernels, "INTERPRETED", False)  # as if TRITON_INTERPRET were unset
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_fused_ops("cpu", torch.float32)


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------


def test_engine_with_fused_ops_matches_transformers(kernels, model, hf_model, reference):
    """Chunked prompts mixed with decodes (8-token budget, 4-token blocks) through fused_forward."""
    from minivllm import LLM, SamplingParams

    prompts, lengths = random_prompts([11, 2, 5], seed=9), [4, 6, 3]
    llm = LLM(model, fused_ops=True, block_size=4, num_kv_blocks=32, max_num_batched_tokens=8)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [reference(hf_model, p, n) for p, n in zip(prompts, lengths)]


def test_engine_with_merged_projections_and_triton_attention(kernels, qwen3_model, hf_models, reference):
    """The whole chapter-9 path on the CPU: merged projections (q, k, v are strided views of
    one GEMM's output) into chapter 8's Triton attention, through the engine."""
    from minivllm import LLM, SamplingParams

    model = copy.deepcopy(qwen3_model)
    merge_projections(model)
    prompts, lengths = random_prompts([9, 3], seed=10), [3, 4]
    llm = LLM(model, attention="triton", fused_ops=True, block_size=4, num_kv_blocks=16, max_num_batched_tokens=8)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [reference(hf_models["qwen3"], p, n) for p, n in zip(prompts, lengths)]
    assert [out.outputs[0].token_ids for out in outputs] == expected


def test_replayed_decode_steps_with_fused_ops_and_triton_attention(kernels, qwen3_model, hf_models, reference):
    """Decode steps as a CUDA graph runs them (EagerGraph stands in on the CPU): batch-size
    buckets with padding rows, block tables and the decode grid sized for max_model_len, far
    longer than these sequences; the fused forward and Triton attention inside."""
    from minivllm import LLM, SamplingParams
    from minivllm.worker.cuda_graphs import EagerGraph
    from minivllm.worker.model_runner import ModelRunner

    llm = LLM(qwen3_model, attention="triton", fused_ops=True, block_size=4, num_kv_blocks=40, max_num_seqs=4)
    engine = llm.engine
    engine.core.runner = ModelRunner(engine.model, dataclasses.replace(engine.config, cuda_graphs=True), graph_class=EagerGraph)
    replayed, replay = [], engine.core.runner.graphs.replay
    engine.core.runner.graphs.replay = lambda size, num_seqs: replayed.append(num_seqs) or replay(size, num_seqs)
    prompts, lengths = random_prompts([6, 2, 9], seed=11), [5, 3, 4]  # 3 sequences: the 4-row bucket pads one
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [reference(hf_models["qwen3"], p, n) for p, n in zip(prompts, lengths)]
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert 3 in replayed, f"no 3-sequence decode step was replayed (replayed: {replayed})"
