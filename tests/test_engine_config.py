"""EngineConfig: the engine's settings, validated once, with every "choose for me" decided by
resolve() for the model and its device."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from minivllm import EngineConfig, LLMEngine
from minivllm.config import engine as engine_config

pytestmark = [pytest.mark.ch07, pytest.mark.floors]


def on_cuda(model) -> SimpleNamespace:
    """The model's shape, as if it sat on a GPU (resolve reads only config, device and dtype)."""
    return SimpleNamespace(config=model.config, device=torch.device("cuda"), dtype=torch.bfloat16)


def test_resolve_decides_every_setting_left_to_the_engine(qwen3_model):
    resolved = EngineConfig().resolve(qwen3_model)
    optional = {"speculative_config", "kv_transfer_config"}  # None there is a decision: no speculation, no connector
    assert all(getattr(resolved, f.name) is not None for f in dataclasses.fields(resolved) if f.name not in optional)
    assert resolved.max_model_len == qwen3_model.config.max_position_embeddings
    assert (resolved.attention, resolved.cuda_graphs, resolved.piecewise_graphs, resolved.fused_ops) == (
        "torch", False, False, False)  # a CPU
    assert resolved.enable_prefix_caching is engine_config.PREFIX_CACHING_DEFAULT  # as the chapter set it
    assert EngineConfig(max_model_len=64, num_kv_blocks=9).resolve(qwen3_model).num_kv_blocks == 9  # given: kept


def test_the_engine_runs_on_its_resolved_config(qwen3_model):
    engine = LLMEngine(qwen3_model, config=EngineConfig(block_size=4, num_kv_blocks=12, max_num_seqs=3))
    assert engine.config.block_size == engine.core.block_manager.block_size == 4
    assert engine.core.block_manager.num_blocks == 12 and engine.core.runner.pool.num_blocks == 13  # + the graphs' spare
    assert engine.core.scheduler.max_num_seqs == 3 and engine.max_model_len == engine.config.max_model_len


@pytest.mark.parametrize("settings, match", [
    (dict(block_sise=8), "unknown engine setting 'block_sise'"),
    (dict(block_size=8, cuda_graph=True), "unknown engine setting 'cuda_graph'"),
    (dict(attention="flash"), "unknown attention backend 'flash'"),
    (dict(block_size=16.0), "block_size must be an integer"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer"),
    (dict(fused_ops="yes"), "fused_ops must be True, False or None"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be True, False or None"),
])
def test_bad_settings_are_refused_by_name(qwen3_model, settings, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(qwen3_model, **settings)


def test_settings_come_as_keywords_or_as_a_config_not_both(qwen3_model):
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(qwen3_model, config=EngineConfig(), block_size=8)
    with pytest.raises(ValueError, match="config must be an EngineConfig"):
        LLMEngine(qwen3_model, config={"block_size": 8})


def test_cuda_graphs_with_pytorch_attention_is_refused_with_the_reason(qwen3_model):
    """Inside a captured graph chapter 6's decode gathers max_model_len tokens for every row."""
    gpu_model = on_cuda(qwen3_model)
    with pytest.raises(ValueError, match="cuda_graphs=True needs attention='triton'.*GiB per layer"):
        EngineConfig(attention="torch", cuda_graphs=True, num_kv_blocks=64).resolve(gpu_model)
    # Left to the engine, graphs go with Triton only: PyTorch attention on a GPU runs eagerly.
    assert EngineConfig(attention="torch", num_kv_blocks=64).resolve(gpu_model).cuda_graphs is False
    assert EngineConfig(attention="triton", cuda_graphs=True, num_kv_blocks=64).resolve(gpu_model).cuda_graphs
