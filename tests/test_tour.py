"""The tour on a tiny workload: the JSON it writes has the promised structure, every stage
agrees with transformers, and the agreement check itself catches wrong tokens."""
from __future__ import annotations

import json

import pytest

from minivllm.course.bench.harness import StageResult
from minivllm.course.bench.peers import continuous_batching_unavailable
from minivllm.course.bench.tour import agreement
from minivllm.entrypoints.cli import main

pytestmark = pytest.mark.floors


def test_tour_writes_json_and_figure(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # results and figures land in the temporary folder
    stages = "naive,kv_cache,static_batch,ragged_batch"
    main(["tour", "--model", str(tiny_checkpoint), "--workload", "tiny", "--requests", "4", "--stages", stages,
          "--check", "4", "--device", "cpu"])
    payload = json.loads((tmp_path / "benchmarks/results/tour_cpu_tiny.json").read_text())
    assert (tmp_path / "figures/ladder.png").stat().st_size > 10_000
    assert {"environment", "workload", "rows", "kv_bytes_per_token"} <= payload.keys()
    assert {"device", "dtype", "torch", "transformers", "model"} <= payload["environment"].keys()
    assert len(payload["workload"]["prompt_lens"]) == 4
    rows = {r["name"]: r for r in payload["rows"]}
    peers = ["transformers generate (static, batch 16)"]
    if not continuous_batching_unavailable():  # transformers < 5.5 has no continuous batching to compare with
        peers.append("transformers generate_batch")
    assert list(rows) == stages.split(",") + peers
    for row in rows.values():
        assert row["agrees"] == "✓", f"{row['name']} disagrees with transformers: {row['agrees']}"
        assert row["useful_tokens"] == sum(payload["workload"]["output_lens"])
        assert row["tokens_per_second"] > 0 and 0 <= row["padding_waste"] < 1
    assert rows["naive"]["speedup"] == 1.0
    assert rows["static_batch"]["padding_waste"] > 0 and rows["ragged_batch"]["padding_waste"] == 0
    assert rows[peers[0]]["padding_waste"] > 0 and all(rows[p]["padding_waste"] == 0 for p in peers[1:])


def test_agreement_reports_mismatches():
    reference = {0: [1, 2, 3], 1: [4, 5]}
    assert agreement(StageResult("ok", 1.0, 5, outputs=[[1, 2, 3], [4, 5]]), reference) == "✓"
    assert agreement(StageResult("bad", 1.0, 5, outputs=[[1, 2, 3], [4, 6]]), reference) == "✗ 1/2"


def test_unknown_stage_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="unknown stages"):
        main(["tour", "--model", str(tiny_checkpoint), "--stages", "warp_drive", "--device", "cpu"])


def test_large_workloads_sample_the_one_group_at_a_time_stages(tiny_checkpoint, tmp_path, monkeypatch):
    import minivllm.course.bench.tour as tour

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tour, "LARGE_WORKLOAD_TOKENS", 0)  # treat the tiny workload as large
    payload = tour.run_tour(tiny_checkpoint, device="cpu", workload="tiny", num_requests=6,
                            stages=["naive", "paged"], check=2, peers=False)
    rows = {r["name"]: r for r in payload["rows"]}
    sampled = tour.SAMPLED_STAGES["naive"]
    assert rows["naive"]["note"].startswith(f"ran {sampled} of 6 requests")
    assert rows["naive"]["useful_tokens"] == sum(payload["workload"]["output_lens"][:sampled])
    assert rows["paged"]["note"] == "" and rows["paged"]["useful_tokens"] == sum(payload["workload"]["output_lens"])
    assert all(r["agrees"] == "✓" for r in rows.values())


def test_engines_are_built_before_the_clock_starts(tiny_checkpoint, tmp_path, monkeypatch):
    """An engine stage's set-up (its KV pool; on a GPU its CUDA graphs and the warm-up that
    compiles its kernels) is not generation: no engine is built while a stage is timed."""
    import minivllm.course.bench.tour as tour
    from minivllm.engine.llm_engine import LLMEngine

    monkeypatch.chdir(tmp_path)
    timing, built = [False], []
    run_stage, init = tour.run_stage, LLMEngine.__init__

    def timed_stage(*args, **kwargs):
        timing[0] = True
        try:
            return run_stage(*args, **kwargs)
        finally:
            timing[0] = False

    def recording_init(self, *args, **kwargs):
        built.append(timing[0])
        init(self, *args, **kwargs)

    monkeypatch.setattr(tour, "run_stage", timed_stage)
    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    payload = tour.run_tour(tiny_checkpoint, device="cpu", workload="tiny", num_requests=4,
                            stages=["continuous", "cuda_graphs"], check=2, peers=False)
    assert all(r["agrees"] == "✓" for r in payload["rows"])
    assert built and not any(built), f"{sum(built)} of {len(built)} engines were built while a stage was timed"


def test_the_gpu_tour_runs_every_stage_on_every_request_and_a_large_workload_samples():
    """The GPU tour's own workload (tour_gpu) is small enough for naive decoding at ~30 tok/s, so
    no stage is extrapolated; on a large one (nano) the launch-bound stages run a sample on a GPU
    and, past the CPU's larger threshold, on a CPU too."""
    import minivllm.course.bench.tour as tour
    from minivllm.course.bench.workloads import make_workload

    work = make_workload(tour.GPU_DEFAULT_WORKLOAD, 151936)
    assert work.num_output_tokens <= tour.GPU_LARGE_WORKLOAD_TOKENS
    assert all(tour.sample_size(name, work, on_gpu=True) is None for name in tour.STAGES)
    nano = make_workload("nano", 151936)
    for name, size in tour.GPU_SAMPLED_STAGES.items():
        assert tour.sample_size(name, nano, on_gpu=True) == size
        assert tour.sample_size(name, nano, on_gpu=False) == tour.SAMPLED_STAGES[name]
    assert tour.sample_size("continuous", nano, on_gpu=True) is None
    assert tour.sample_size("naive", nano.subset(2), on_gpu=True) is None  # all of it already


def test_a_time_limit_cuts_samples_and_every_row_is_saved_as_it_ends(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """Under a time limit a sampled stage runs at least one group and stops when its share is
    spent; the results are saved after every stage, marked incomplete until the last, and each
    row is printed as a plain line when it ends."""
    import minivllm.course.bench.tour as tour

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tour, "LARGE_WORKLOAD_TOKENS", 0)  # the tiny workload counts as large: naive is sampled
    monkeypatch.setattr(tour, "MIN_STAGE_SECONDS", float("-inf"))  # no stage skipped, however late
    saved = []
    real_save = tour.save_results
    monkeypatch.setattr(tour, "save_results", lambda name, payload, complete=None: saved.append(
        ([r["name"] for r in payload["rows"]], complete)) or real_save(name, payload, complete))
    payload = tour.run_tour(tiny_checkpoint, device="cpu", workload="tiny", num_requests=6, stages=["naive", "paged"],
                            check=2, peers=False, time_limit=1e-3)
    rows = {r["name"]: r for r in payload["rows"]}
    assert rows["naive"]["note"] == "ran 1 of 6 requests, rate extrapolated (its time budget ended the sample)"
    assert rows["naive"]["useful_tokens"] == payload["workload"]["output_lens"][0]
    assert rows["naive"]["agrees"] == "✓" and rows["paged"]["agrees"] == "✓"
    assert saved == [(["naive"], False), (["naive", "paged"], False), (["naive", "paged"], True)]
    printed = capsys.readouterr().out
    assert "naive: " in printed and "paged: " in printed


def test_a_stage_with_no_time_left_is_skipped_and_named(tiny_checkpoint, tmp_path, monkeypatch):
    import minivllm.course.bench.tour as tour

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tour, "MIN_STAGE_SECONDS", 1e9)
    payload = tour.run_tour(tiny_checkpoint, device="cpu", workload="tiny", num_requests=2, stages=["naive", "paged"],
                            check=1, peers=False, time_limit=5)
    saved = json.loads((tmp_path / "benchmarks/results/tour_cpu_tiny.json").read_text())
    assert saved["rows"] == [] and saved["skipped"] == ["naive", "paged"] and saved["complete"] is True
    assert payload["skipped"] == saved["skipped"]  # what it returns is what it saved
    for bad in (0, -1, True, "5"):
        with pytest.raises(ValueError, match="time_limit"):
            tour.run_tour(tiny_checkpoint, device="cpu", workload="tiny", time_limit=bad)
