"""The decoder equals transformers' own: logits and greedy tokens, loaded from a saved folder
and from memory, on tiny Llama (GQA, llama3 RoPE, untied), Qwen2 (bias, tied) and Qwen3
(q/k norm, wide head_dim) checkpoints; plus the loader's errors and the KV-size facts."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import minivllm
from minivllm.stages.naive import CausalAttention

pytestmark = pytest.mark.floors


def logits_of(model: minivllm.Decoder, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)), CausalAttention(len(ids), model.device))
    return model.lm_head(hidden)


def test_logits_match_transformers_in_memory(model, hf_model):
    ids = torch.randint(0, hf_model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(logits_of(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_logits_match_transformers_from_saved_folder(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    model = minivllm.load_model(tmp_path, device="cpu")
    ids = torch.arange(30) % hf_model.config.vocab_size
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(logits_of(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_positions_far_beyond_the_prompt_match(model, hf_model):
    """RoPE at large positions (past llama3's original context of 64 in the tiny config)."""
    ids = torch.tensor([3, 1, 4, 1, 5])
    positions = torch.arange(200, 205)
    with torch.no_grad():
        expected = hf_model(ids[None], position_ids=positions[None]).logits[0]
    hidden = model(ids, positions, CausalAttention(len(ids), "cpu"))
    torch.testing.assert_close(model.lm_head(hidden), expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_stays_close_to_float32(model, hf_model):
    ids = torch.arange(24) % hf_model.config.vocab_size
    fp32 = logits_of(model, ids)
    bf16 = logits_of(minivllm.load_model(hf_model, device="cpu", dtype=torch.bfloat16), ids).float()
    assert (bf16 - fp32).abs().max() < 0.1 * fp32.abs().max()


def test_config_fields_follow_the_family(model, family):
    cfg = model.config
    assert cfg.qk_norm == (family == "qwen3")
    assert cfg.qkv_bias == (family == "qwen2")
    assert cfg.tie_word_embeddings == (family == "qwen2")
    assert cfg.rope_type == ("llama3" if family == "llama" else "default")
    assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name, dtype, kib",
    [("llama-2-7b", torch.float16, 512), ("qwen3-0.6b", torch.bfloat16, 112), ("smollm2-135m", torch.bfloat16, 22.5)],
)
def test_kv_bytes_per_token_of_real_shapes(name, dtype, kib):
    """Published figures (../shared/README.md): 2 x layers x kv_heads x head_dim x bytes."""
    from minivllm.loader import read_config

    assert read_config(minivllm.CONFIGS / f"{name}.json").kv_bytes_per_token(dtype) == kib * 1024


def test_config_json_gives_random_weights_of_the_real_shape(tmp_path):
    path = tmp_path / "shape.json"
    path.write_text(json.dumps(dict(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16).to_dict())))
    model = minivllm.load_model(path, device="cpu")
    assert model.config.num_layers == 1 and model.config.head_dim == 16
    assert model.layers[0].self_attn.q_proj.weight.std() > 0.01  # not left at zero


def test_missing_path_names_the_path():
    with pytest.raises(FileNotFoundError, match="no/such/folder"):
        minivllm.load_model("./no/such/folder", device="cpu")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        minivllm.load_model(tmp_path, device="cpu")


def test_folder_without_weights_says_so(tmp_path):
    transformers.Qwen3Config(num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        minivllm.load_model(tmp_path, device="cpu")


def test_unsupported_rope_type_is_refused():
    config = transformers.LlamaConfig(num_hidden_layers=1, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        minivllm.loader.config_from_hf(config)
