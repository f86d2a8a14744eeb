"""Chapter 9's roofline: the floor's arithmetic against hand-computed cases and the shared notes'
nano numbers, a measured bandwidth, the benchmark script end to end on a tiny checkpoint, and
its warm-up, which must take every path the timed run takes."""
from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path

import pytest
import torch
from tiny_models import run_script

from minivllm import LLM, ModelConfig, SamplingParams
from minivllm.course.bench.peers import continuous_batching_unavailable
from minivllm.course.bench.roofline import decode_floor
from minivllm.course.bench.timing import copy_bandwidth
from minivllm.course.bench.workloads import Workload, make_workload, warmup_workloads
from minivllm.loader import CONFIGS, read_config
from minivllm.model import Decoder

pytestmark = [pytest.mark.ch09, pytest.mark.floors]

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "engine_roofline.py"


def toy_config(tied: bool) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=2, max_position_embeddings=64, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_the_floor_of_two_requests_by_hand(tied):
    config = toy_config(tied)
    # Weights read per step: every parameter the model really has (a tied matrix is one
    # parameter), less the embedding table when the LM head has its own matrix.
    params = sum(p.numel() for p in Decoder(config).parameters())  # parameters() yields a tied matrix once
    per_step = (params - (0 if tied else 10 * 4)) * 2
    # Prompts of 3 and 5 tokens, outputs of 2 and 4: the steps making tokens 1, 2 of the first
    # read 3, 4 cached tokens; those making tokens 1..4 of the second read 5, 6, 7, 8.
    kv_tokens = (3 + 4) + (5 + 6 + 7 + 8)
    kv_per_token = 2 * 1 * 1 * 2 * 2  # K and V, 1 layer, 1 KV head, head_dim 2, bf16
    floor = decode_floor(config, torch.bfloat16, [3, 5], [2, 4], bandwidth=1000.0)
    assert floor.weight_bytes == per_step
    assert floor.weight_reads == 4  # the longest output
    assert floor.kv_bytes == kv_tokens * kv_per_token
    assert floor.seconds == pytest.approx((4 * per_step + kv_tokens * kv_per_token) / 1000)
    assert floor.tokens_per_second == pytest.approx(6 / floor.seconds)


def test_the_nano_workload_matches_the_shared_notes():
    """Qwen3-0.6B in bf16 at 3.0 TB/s: weights of 1.19 GB, and for the nano workload's lengths
    (uniform on 100-1024, independent: here a 16 x 16 grid of them) about 15 TB of KV reads
    plus 1.2 TB of weight reads, roughly 26k output tok/s (shared notes, section 3)."""
    config = read_config(CONFIGS / "qwen3-0.6b.json")
    grid = [round(100 + 924 * (i + 0.5) / 16) for i in range(16)]
    prompts, outputs = [p for p in grid for _ in grid], [n for _ in grid for n in grid]
    floor = decode_floor(config, torch.bfloat16, prompts, outputs, bandwidth=3.0e12)
    assert floor.weight_bytes == pytest.approx(1.19e9, rel=0.01)
    assert floor.weight_bytes * floor.weight_reads == pytest.approx(1.2e12, rel=0.03)
    assert floor.kv_bytes == pytest.approx(15e12, rel=0.03)
    assert floor.tokens_per_second == pytest.approx(26_000, rel=0.04)
    # The seeded nano workload itself: its longest output is 1,024, so 1,024 weight reads (the count).
    work = make_workload("nano", config.vocab_size, seed=0)
    seeded = decode_floor(config, torch.bfloat16, [len(p) for p in work.prompts], work.output_lens, 3.0e12)
    assert seeded.weight_reads == 1024
    assert seeded.tokens_per_second == pytest.approx(25_600, rel=0.08)


def test_bad_arguments_are_refused():
    config = toy_config(tied=True)
    for prompts, outputs, bandwidth in (([3], [2, 4], 1.0), ([], [], 1.0), ([3], [0], 1.0), ([3], [2.0], 1.0),
                                        ([3], [2], 0.0), ([3], [2], True)):
        with pytest.raises(ValueError):
            decode_floor(config, torch.float32, prompts, outputs, bandwidth)
    with pytest.raises(ValueError):
        decode_floor(config, "bfloat16", [3], [2], 1.0)
    with pytest.raises(ValueError):
        copy_bandwidth("cpu", nbytes=0)
    with pytest.raises(ValueError):
        copy_bandwidth("meta")


def test_copy_bandwidth_is_positive():
    assert copy_bandwidth("cpu", nbytes=2**22, repeats=3) > 0


def test_the_floor_is_priced_at_the_higher_of_copy_and_read(monkeypatch):
    from minivllm.course.bench import timing

    assert timing.read_bandwidth("cpu", nbytes=2**22, repeats=3) > 0
    for bad in (dict(nbytes=0), dict(nbytes=2**20, repeats=True)):
        with pytest.raises(ValueError):
            timing.read_bandwidth("cpu", **bad)
    monkeypatch.setattr(timing, "copy_bandwidth", lambda device: 4.0e12)
    monkeypatch.setattr(timing, "read_bandwidth", lambda device: 4.3e12)
    assert timing.floor_bandwidth("cpu") == dict(copy=4.0e12, read=4.3e12, floor=4.3e12)


def test_the_benchmark_runs_end_to_end(tiny_checkpoint, tmp_path):
    payload = run_script(BENCHMARK, ["--model", str(tiny_checkpoint), "--workload", "tiny", "--requests", "4",
                                     "--peer-requests", "2", "--device", "cpu"],
                         tmp_path, "09_roofline_cpu", figures=["09_roofline"])
    # transformers < 5.5 has no continuous batching to compare with
    peer = [] if continuous_batching_unavailable() else ["transformers generate_batch, first 2 requests"]
    assert [row["name"] for row in payload["rows"]] == ["minivllm (eager)", "minivllm (eager), first 2 requests", *peer]
    assert payload["complete"] is True
    assert payload["bandwidth"]["bytes_per_second"] == max(payload["bandwidth"]["copy_bytes_per_second"],
                                                           payload["bandwidth"]["read_bytes_per_second"])
    output_lens = payload["workload"]["output_lens"]
    floors = {"tiny": payload["floor"], "first 2 requests": payload["peer_workload"]["floor"]}
    assert floors["tiny"]["weight_reads"] == max(output_lens) and floors["tiny"]["output_tokens"] == sum(output_lens)
    assert floors["first 2 requests"]["output_tokens"] == sum(output_lens[:2])
    for row in payload["rows"]:
        n = 4 if row["workload"] == "tiny" else 2
        assert row["same_tokens_as_engine"] == f"{n}/{n}", row["name"]
        assert row["requests_finished"] == f"{n}/{n}"
        assert row["useful_tokens"] == sum(output_lens[:n])
        assert row["share_of_roofline"] == pytest.approx(floors[row["workload"]]["seconds"] / row["median_seconds"])
        assert (row["speedup_over_transformers"] is None) == (n == 4 or not peer)


def test_the_warm_up_takes_every_path_the_timed_run_takes(qwen3_model):
    """A Triton kernel compiles once per path: prefill, decode in one pass (batches that fill
    the GPU), decode split into partitions (a few long contexts). Under a decode plan that
    splits small batches of long contexts, every path of the timed run is taken by the warm-up
    first, on the same engine."""
    pytest.importorskip("triton")
    from minivllm.attention.triton_kernels import decode_plan

    rng = random.Random(0)
    n = 24
    work = Workload("test", [[rng.randrange(97) for _ in range(rng.randint(100, 200))] for _ in range(n)],
                    [rng.randint(1, 30) for _ in range(n)])
    llm = LLM(qwen3_model, max_num_seqs=n, enable_prefix_caching=False)
    kv_heads, paths, run = qwen3_model.config.num_kv_heads, [], llm.engine.core.runner.run

    def recording_run(schedule):
        decode = all(n == 1 and s.num_computed_tokens == s.num_tokens - 1 for s, n in
                     zip(schedule.seqs, schedule.num_new_tokens))
        context = max(s.num_computed_tokens + 1 for s in schedule.seqs)
        split = decode_plan(len(schedule.seqs), kv_heads, context, block_n=16, num_sms=2) > 1
        paths[-1].add(("decode", "split" if split else "one pass") if decode else ("prefill",))
        return run(schedule)

    llm.engine.core.runner.run = recording_run

    def generate(w: Workload) -> None:
        paths.append(set())
        llm.generate(w.prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in w.output_lens],
                     use_tqdm=False)

    for warm in warmup_workloads(work):
        generate(warm)
    warm_paths = set().union(*paths)
    generate(work)
    assert len(paths[-1]) == 3, f"this workload should take all three paths, took {paths[-1]}"
    assert paths[-1] <= warm_paths, f"the timed run takes {paths[-1] - warm_paths}, which the warm-up never took"


def test_the_peer_stops_at_its_deadline_with_what_it_finished(qwen3_model):
    """transformers past its deadline: the requests it had not finished come back as None, and
    the roofline's row counts only those it finished."""
    from minivllm.course.bench.peers import hf_generate_batch, to_transformers

    if continuous_batching_unavailable():
        pytest.skip("this transformers has no continuous batching")
    hf = to_transformers(qwen3_model)
    prompts, lens = [[1, 2, 3], [4, 5, 6, 7]], [3, 4]
    assert hf_generate_batch(hf, prompts, lens, deadline=time.perf_counter() - 1) == [None, None]
    done = hf_generate_batch(hf, prompts, lens, deadline=time.perf_counter() + 60)
    assert [len(out) for out in done] == lens
    spec = importlib.util.spec_from_file_location("engine_roofline", BENCHMARK)
    engine_roofline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_roofline)
    row = engine_roofline.finish_row(dict(seconds=[2.0]), [done[0], None], done, lens)
    assert row["requests_finished"] == "1/2" and row["useful_tokens"] == 3 and row["tokens_per_second"] == 1.5
    assert row["same_tokens_as_engine"] == "1/1"


@pytest.mark.parametrize("settings", [dict(), dict(attn_implementation="paged|eager"), dict(max_batch_tokens=None),
                                      dict(use_cuda_graph=False)], ids=["default", "paged", "auto-batch", "no-graphs"])
def test_every_peer_setting_gives_transformers_greedy_tokens(hf_models, reference, settings):
    """Each setting benchmarks/peer_settings.py compares runs the same greedy requests (each its
    own length, two runs on one manager) to transformers' own generate's tokens: the peer's speed
    is compared on the same work whatever it is set to."""
    from minivllm.course.bench.peers import PeerSettings, continuous_batching, generate_on, to_transformers
    from minivllm.loader import load_model

    if continuous_batching_unavailable():
        pytest.skip("this transformers has no continuous batching")
    hf = to_transformers(load_model(hf_models["qwen3"], device="cpu"))
    prompts, lens = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 12], [3, 5, 2]
    with continuous_batching(hf, prompts, lens, PeerSettings(**settings)) as manager:
        assert generate_on(manager, prompts[:1], [2]) == [reference(hf_models["qwen3"], prompts[0], 2)]
        got = generate_on(manager, prompts, lens)
    assert got == [reference(hf_models["qwen3"], p, n) for p, n in zip(prompts, lens)]
