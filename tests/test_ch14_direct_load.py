"""Chapter 14, finished: each rank reads only its shard (distributed/direct_load.py).

The shards read from a checkpoint's safetensors, or drawn for a config-only model, equal the ones
cut from the whole model (shard.py) at N = 1, 2 and 4; a config-only model is the same model at
every N; the engine at N = 2, given a checkpoint folder, never loads the whole model and its
greedy tokens equal transformers'; and each rank's peak resident memory, measured in a process
of its own on a ~67 MB random model, is about its share of the weights (at most 0.7x at N = 2),
where cutting shards from the whole model costs at least the whole.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_ch14_tensor_parallel import gone
from tiny_models import hf_greedy, random_prompts, tiny_hf_model

from minivllm import LLM, SamplingParams, load_model
from minivllm.distributed.direct_load import UnloadedDecoder, load_shard
from minivllm.distributed.layers import Communicator
from minivllm.distributed.shard import shard_decoder
from minivllm.loader import open_weights
from minivllm.model import Decoder

pytestmark = [pytest.mark.ch14, pytest.mark.floors]

FAMILIES = ("llama", "qwen2", "qwen3")
# ~67 MB of fp32 weights: big enough that the weights, not torch's own libraries, decide the peak.
BIG = dict(model_type="qwen3", vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
           tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Each tiny transformers model, saved as a safetensors checkpoint: (folder, the model)."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        model = tiny_hf_model(family)
        model.save_pretrained(folder)
        out[family] = folder, model
    return out


def assert_same_shards(source, n: int) -> None:
    whole = load_model(source, "cpu")
    for rank in range(n):
        cut = shard_decoder(whole, Communicator(rank, n)).state_dict()
        read = load_shard(open_weights(source), Communicator(rank, n), "cpu", torch.float32).state_dict()
        assert cut.keys() == read.keys()
        for name in cut:
            assert torch.equal(cut[name], read[name]), f"rank {rank} of {n}: {name}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_shards_read_from_a_checkpoint_are_the_shards_cut_from_the_model(checkpoints, family, n):
    assert_same_shards(checkpoints[family][0], n)


@pytest.mark.parametrize("n", [2, 4])
def test_a_config_only_model_is_the_same_model_at_every_size(tmp_path, n):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BIG, "vocab_size": 1000, "num_hidden_layers": 1}))  # V: no N divides the blocks
    assert_same_shards(config, n)
    again = load_model(config, "cpu")
    assert torch.equal(again.layers[0].mlp.down_proj.weight, load_model(config, "cpu").layers[0].mlp.down_proj.weight)
    std = again.layers[0].mlp.down_proj.weight.std().item()
    assert abs(std - 0.02) < 0.002  # transformers' initializer_range


def test_a_checkpoint_that_does_not_match_is_refused(checkpoints, tmp_path):
    folder, model = checkpoints["llama"]
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="missing.*up_proj"):
        open_weights(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_from_a_checkpoint_at_two_ranks(checkpoints, family):
    folder, hf = checkpoints[family]
    prompts = random_prompts([5, 11, 3], seed=3)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    assert not dist.is_initialized()
    llm = LLM(str(folder), device="cpu", tensor_parallel_size=2, block_size=4, num_kv_blocks=64)
    runner = llm.engine.core.runner
    try:
        assert isinstance(llm.engine.model, UnloadedDecoder)  # rank 0 never held the whole model
        assert runner.model.layers[0].mlp.gate_proj.out_features == hf.config.intermediate_size // 2
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    finally:
        pids = runner.pids
        runner.shutdown()
    assert gone(pids)
    assert got == expected


PEAK = textwrap.dedent("""
    import json, sys, torch
    from minivllm import load_model
    from minivllm.distributed.direct_load import load_shard
    from minivllm.distributed.layers import Communicator
    from minivllm.distributed.shard import shard_decoder
    from minivllm.loader import open_weights

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    source, how, rank, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.ones(1) @ torch.ones(1)  # torch's and transformers' own start-up costs, before the baseline
    open_weights(source)
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    if how == "direct":
        model = load_shard(open_weights(source), Communicator(rank, n), "cpu", torch.float32)
    else:  # chapter 14 before: the whole model, then its shard cut from it
        model = shard_decoder(load_model(source, "cpu"), Communicator(rank, n))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps(dict(peak=status("VmHWM") - base, held=held)))
""")


def peak_memory(config: Path, runs: list[tuple[str, int, int]]) -> list[dict]:
    """For each (how, rank, n), a fresh process (all at once) loads rank `rank`'s shard: its
    resident memory's peak above its baseline, and the bytes of parameters it ends up holding."""
    processes = [subprocess.Popen([sys.executable, "-c", PEAK, str(config), how, str(rank), str(n)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for how, rank, n in runs]
    try:
        outs = [p.communicate(timeout=100) for p in processes]
    finally:
        for p in processes:
            p.kill()
            p.wait()
    for p, (_, err) in zip(processes, outs):
        # A worker's traceback in the message: a student's unfinished shard exercise names itself there.
        assert p.returncode == 0, f"a loading process failed:\n{err[-3000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.timeout(120)
def test_each_rank_holds_only_about_its_share(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(BIG))
    with torch.device("meta"):
        weights = sum(p.numel() * 4 for p in Decoder(open_weights(config).config).parameters())
    assert 50e6 < weights < 100e6
    rank0, rank1, before = peak_memory(config, [("direct", 0, 2), ("direct", 1, 2), ("cut", 0, 2)])
    assert before["peak"] > weights  # cutting shards from the whole model: the whole, and its shard beside it
    for rank, share in enumerate((rank0, rank1)):
        assert share["held"] < 0.55 * weights
        assert share["peak"] <= 0.7 * weights, f"rank {rank} of 2 peaked at {share['peak'] / weights:.2f}x the weights"
