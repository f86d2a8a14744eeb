"""Chapter 9's step profile, on the CPU: invariants of the trace, never timings.

A profiled step must show the engine's five phases in order, side by side inside the step;
its operator calls must follow the model's structure (the same calls for every layer, so the
count grows by a fixed amount per layer, and q/k norm adds calls); and the result must survive
a round trip through JSON, which is how chapter 9 stores and replots it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import run_script

from minivllm import LLMEngine, ModelConfig, SamplingParams
from minivllm.course.bench.profiling import VARIANTS, StepProfile, profile_steps
from minivllm.engine.llm_engine import STEP_PHASES
from minivllm.model import Decoder
from minivllm.course.plots.profile import plot_step_breakdown, plot_step_timeline

pytestmark = [pytest.mark.ch09, pytest.mark.floors]
SCRIPT = Path(__file__).parents[1] / "benchmarks" / "step_profile.py"

SMALL = dict(batch_size=3, context=20, steps=2, warmup=1)


@pytest.fixture(scope="module")
def profile(qwen3_model) -> StepProfile:
    return profile_steps(qwen3_model, **SMALL, **VARIANTS["eager"])


def toy_model(num_layers: int, qk_norm: bool = True) -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=num_layers,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, qk_norm=qk_norm)
    return Decoder(config).eval()


def test_a_step_shows_the_five_phases_in_order_inside_the_step(profile, qwen3_model):
    assert len(profile.steps) == SMALL["steps"]
    for step in profile.steps:
        assert step.phase_order() == list(STEP_PHASES)
        assert step.batch_size == SMALL["batch_size"]  # every request decoded in every profiled step
        for span in step.phases:
            assert 0 <= span.start <= span.end <= step.wall_ms
        for before, after in zip(step.phases, step.phases[1:]):
            assert before.end <= after.start, f"{before} overlaps {after}"
        # One range per decoder layer, in order, all inside "forward".
        assert [s.name for s in step.layers] == [f"layer {i}" for i in range(qwen3_model.config.num_layers)]
        forward = [s for s in step.phases if s.name == "forward"]
        assert all(any(f.start <= s.start and s.end <= f.end for f in forward) for s in step.layers)
        # Top-level operator calls: inside the step, and never one inside another.
        assert step.host_ops and step.launches == len(step.host_ops)
        assert all(0 <= op.start <= op.end <= step.wall_ms for op in step.host_ops)
        for before, after in zip(step.host_ops, step.host_ops[1:]):
            assert before.end <= after.start
        host = step.host_ms()
        assert sum(host.values()) == pytest.approx(step.wall_ms, abs=1e-3)
        assert all(step.op_ms()[name] <= host[name] + 1e-3 for name in STEP_PHASES)
        assert step.kernels == [] and step.device_busy_ms() is None  # a CPU has no device lane
    assert profile.count_label == "operator calls"


def calls_per_step(model: Decoder) -> int:
    counts = {step.launches for step in profile_steps(model, **SMALL).steps}
    assert len(counts) == 1, f"the same decode step made different numbers of calls: {counts}"
    return counts.pop()


def test_operator_calls_grow_by_a_fixed_amount_per_layer():
    one, two, three = (calls_per_step(toy_model(n)) for n in (1, 2, 3))
    assert 0 < one < two < three
    assert three - two == two - one  # every layer asks for the same operators


def test_qk_norm_adds_operator_calls_in_every_layer():
    with_norm, without = calls_per_step(toy_model(2, qk_norm=True)), calls_per_step(toy_model(2, qk_norm=False))
    extra = with_norm - without
    assert extra > 0 and extra % 2 == 0  # the same extra calls in each of the two layers


def test_the_profile_round_trips_through_json(profile):
    text = json.dumps(profile.to_dict())
    again = StepProfile.from_dict(json.loads(text))
    assert again == profile
    summary = json.loads(text)["summary"]
    assert summary["launches"] == profile.steps[0].launches and summary["count_label"] == "operator calls"
    assert 0 <= summary["fastest_step"] < len(profile.steps)


def test_the_plots_draw_from_the_json_form(profile):
    d = json.loads(json.dumps(profile.to_dict()))
    fig = plot_step_timeline([d, d])
    assert len(fig.axes) == 2
    assert plot_step_breakdown([d]).axes


def test_bad_arguments_are_refused(qwen3_model):
    with pytest.raises(ValueError, match="batch_size"):
        profile_steps(qwen3_model, batch_size=0)
    with pytest.raises(ValueError, match="steps"):
        profile_steps(qwen3_model, steps=1.5)
    with pytest.raises(ValueError, match="max_model_len"):
        profile_steps(qwen3_model, context=250)  # the tiny model's context is 256
    engine = LLMEngine(qwen3_model, num_kv_blocks=64)
    with pytest.raises(ValueError, match="engine options"):
        profile_steps(engine, cuda_graphs=False)
    engine.add_request(prompt=[1, 2, 3], params=SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        profile_steps(engine)


def test_the_script_writes_its_figure_and_json(tiny_checkpoint, tmp_path):
    payload = run_script(SCRIPT, ["--model", str(tiny_checkpoint), "--device", "cpu", "--batch-size", "2",
                                  "--context", "16", "--steps", "2"],
                         tmp_path, "09_step_profile_cpu", figures=["09_step_timeline"])
    assert [p["variant"] for p in payload["profiles"]] == ["eager"]
