"""Chapter 17's online measurement (course/bench/disagg_serving.py): the workload it sends, the
ITL and TTFT it computes from token arrival times (against hand-computed values), the round it
picks for the figure, and, end to end on the cheap model, that every setup answers every request
with exactly its tokens and that the files setup's producer wrote every full block it was sent."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.course.bench import disagg_serving
from minivllm.course.bench.disagg import transfer_config
from minivllm.course.bench.disagg_serving import (
    Planned,
    itl_points,
    long_prompt_arrivals,
    measure,
    median_round,
    median_summary,
    summarize,
    timelines,
)
from minivllm.course.bench.load import RequestResult, run_fast
from minivllm.course.bench.split_serving import write_cheap_model
from minivllm.course.plots.disagg import plot_itl_over_time

pytestmark = [pytest.mark.ch17, pytest.mark.floors, pytest.mark.timeout(240)]


def result(start: float, times: list[float], tokens: int | None = None) -> RequestResult:
    return RequestResult(tokens or len(times), start=start, token_times=times, output_tokens=tokens or len(times))


def test_the_workload_is_streams_at_once_and_long_prompts_on_a_clock():
    plan = long_prompt_arrivals(1000, streams=3, stream_prompt=5, stream_tokens=7, long_prompts=4, long_prompt=40,
                                long_tokens=2, interval=0.25, first_long=0.5, seed=3)
    assert [p.kind for p in plan] == ["stream"] * 3 + ["long"] * 4
    assert [p.at for p in plan] == [0.0, 0.0, 0.0, 0.5, 0.75, 1.0, 1.25]
    assert [(len(p.prompt), p.max_tokens) for p in plan] == [(5, 7)] * 3 + [(40, 2)] * 4
    assert all(0 <= t < 1000 for p in plan for t in p.prompt)
    assert len({tuple(p.prompt) for p in plan}) == 7, "every prompt is its own: no prefix is shared"
    assert plan == long_prompt_arrivals(1000, streams=3, stream_prompt=5, stream_tokens=7, long_prompts=4,
                                        long_prompt=40, long_tokens=2, interval=0.25, first_long=0.5, seed=3)
    for bad in ({"streams": 0}, {"long_prompt": True}, {"stream_tokens": 2.0}, {"interval": -0.1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            long_prompt_arrivals(1000, **bad)


def test_itl_and_ttft_from_arrival_times_by_hand():
    # stream a: sent at 0.0, tokens at 0.100, 0.105, 0.130 -> TTFT 100 ms, gaps 5 and 25 ms
    # stream b: sent at 0.0, tokens at 0.200, 0.201, 0.211 -> TTFT 200 ms, gaps 1 and 10 ms
    # long:     sent at 0.5, tokens at 0.800, 0.900         -> TTFT 300 ms (its gap is not a stream's)
    # failed:   a stream whose server reported 3 of its 4 tokens
    # not sent: a long prompt due when every stream had ended (None)
    plan = [Planned(0.0, [1], 3, "stream"), Planned(0.0, [2], 3, "stream"), Planned(0.5, [3], 2, "long"),
            Planned(0.0, [4], 4, "stream"), Planned(9.0, [5], 2, "long")]
    t0 = 10.0
    results = [result(t0, [t0 + 0.100, t0 + 0.105, t0 + 0.130]), result(t0, [t0 + 0.200, t0 + 0.201, t0 + 0.211]),
               result(t0 + 0.5, [t0 + 0.8, t0 + 0.9]), result(t0, [t0 + 0.1, t0 + 0.2, t0 + 0.3], tokens=3), None]
    results[3].error = "expected 4 tokens, the server reported 3"
    assert [x for point in itl_points(results[0], t0) for x in point] == pytest.approx([0.105, 0.005, 0.130, 0.025])
    s = summarize(plan, results)
    assert (s["requests"], s["long_prompts_sent"], s["failed"]) == (4, 1, 1)
    assert s["errors"] == ["expected 4 tokens, the server reported 3"]
    assert (s["stream_tokens"], s["stream_chunks"]) == (6, 6)
    # gaps sorted: 1, 5, 10, 25 ms; p50 halfway between 5 and 10; p99 at 0.99 * 3 = 2.97: 10 + 0.97 * 15
    assert s["stream_itl_ms"]["p50"] == pytest.approx(7.5)
    assert s["stream_itl_ms"]["p99"] == pytest.approx(24.55)
    assert s["stream_itl_ms"]["mean"] == pytest.approx(41 / 4)
    assert s["stream_ttft_ms"]["p50"] == pytest.approx(150.0)
    assert s["long_ttft_ms"]["p50"] == pytest.approx(300.0)
    lines = timelines(plan, results, t0)
    assert lines == {"stream_token_ms": [[100.0, 105.0, 130.0], [200.0, 201.0, 211.0], [100.0, 200.0, 300.0]],
                     "long_arrival_ms": [500.0]}
    with pytest.raises(ValueError, match="5 planned requests but 3 results"):
        summarize(plan, results[:3])


def test_long_prompts_are_sent_only_while_a_stream_runs(monkeypatch):
    async def answer(client, model, prompt, max_tokens, timeout):  # a stream takes 0.3 s, a long prompt none
        await asyncio.sleep(0.3 if prompt == [0] else 0.0)
        return result(0.0, [1.0] * max_tokens)

    monkeypatch.setattr(disagg_serving, "stream_completion", answer)
    plan = [Planned(0.0, [0], 2, "stream"), Planned(0.0, [1], 1, "long"), Planned(0.1, [2], 1, "long"),
            Planned(1.5, [3], 1, "long")]
    begun = time.perf_counter()
    results, start = run_fast(disagg_serving.replay("http://127.0.0.1:9", plan))
    assert [r is not None for r in results] == [True, True, True, False]
    assert begun <= start and time.perf_counter() - begun < 1.0, "a long prompt not sent is not waited for"


def test_the_figures_round_is_the_median_one_and_medians_are_per_percentile():
    rounds = [{"round": i, "load_average": [float(i)], "timelines": {"stream_token_ms": [[0.0, p99]],
                                                                      "long_arrival_ms": []},
               "stream_itl_ms": {"p50": p50, "p90": p99, "p99": p99, "mean": p50}}
              for i, (p50, p99) in enumerate([(1.0, 30.0), (3.0, 10.0), (2.0, 20.0)])]
    assert median_round(rounds)["round"] == 2  # p99s 30, 10, 20: the middle one is 20
    assert median_round(rounds[:2])["round"] == 1  # an even count: the lower middle one
    assert median_summary(rounds) == {"stream_itl_ms": {"p50": 2.0, "p90": 20.0, "p99": 20.0, "mean": 2.0}}
    figure = plot_itl_over_time({"one": median_round(rounds)})
    assert figure.axes[0].collections[0].get_offsets().tolist() == [[0.02, 20.0]]  # (seconds, ms) of its one gap
    with pytest.raises(ValueError):
        plot_itl_over_time({})


@pytest.mark.parametrize("where", [{"device": "gpu"}, {"device": "cuda", "dtype": "bf16"}, {"dtype": torch.float32}])
def test_measure_refuses_a_device_or_dtype_serve_would_not_take(tmp_path, where):
    with pytest.raises(ValueError, match="device must be"):
        measure(tmp_path, 100, **where)


def test_each_instance_serves_on_the_device_and_dtype_asked():
    command = disagg_serving.serve_command("m", 8100, "cuda", "bfloat16", "--kv-transfer-config", "{}")
    assert command[command.index("--device") + 1] == "cuda" and command[command.index("--dtype") + 1] == "bfloat16"
    assert "--threads" not in command  # a GPU instance keeps torch's threads; a CPU one gets one
    command = disagg_serving.serve_command("m", 8100, "cpu", None)
    assert command[command.index("--threads") + 1] == "1" and "--dtype" not in command


@pytest.mark.slow
@pytest.mark.floors
@pytest.mark.timeout(600)  # seven servers start side by side: minutes on a loaded 2-core machine
def test_every_setup_answers_every_request_and_the_producer_saves_every_full_block(tmp_path):
    model = write_cheap_model(tmp_path / "model")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    # In-process first, the servers' path in small: a failure here (a stubbed exercise, say) comes with its own
    # message, where the servers' would come as HTTP errors.
    prompt, one_token = list(range(1, 21)), SamplingParams(max_tokens=1, temperature=0.0)
    LLM(str(model), kv_transfer_config=transfer_config("kv_producer", str(tmp_path / "kv"))).generate(
        [prompt], one_token, use_tqdm=False)
    loaded = LLM(str(model), kv_transfer_config=transfer_config("kv_consumer", str(tmp_path / "kv"))).generate(
        [prompt], one_token, use_tqdm=False)[0]
    assert loaded.num_cached_tokens == 16, "the consumer loads the prompt's full block before its last token"
    out = measure(model, vocab, rounds=1, progress=lambda _: None, streams=2, stream_prompt=20, stream_tokens=6,
                  long_prompts=2, long_prompt=100, long_tokens=2, interval=0.0, first_long=0.0)
    for name, setup in out["setups"].items():
        (run,) = setup["rounds"]
        assert (run["requests"], run["long_prompts_sent"], run["failed"]) == (4, 2, 0), (name, run["errors"])
        assert set(setup["medians"]) == {"stream_itl_ms", "stream_ttft_ms", "long_ttft_ms"}
        assert (run["stream_tokens"], len(setup["median_round"]["stream_token_ms"])) == (12, 2), name
        assert 2 <= run["stream_chunks"] <= 12, name  # a reader that falls behind gets several tokens a chunk
    # warm-up (2 streams of 20 tokens: 1 block each, 2 long of 100, sent with them: 6 each) and the round, the same
    assert out["block_files"] == out["expected_block_files"] == 2 * (2 * 1 + 2 * 6)
    assert (out["prompts_with_unsaved_blocks"], out["warm_up_failed"]) == ([], 0)
