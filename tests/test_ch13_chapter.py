"""Chapter 13's script on the embedded model at a tiny size, end to end: it writes its figures and
JSON; with the mask no output breaks its format; every finished JSON fits its schema with and
without free whitespace; the bitmask picture ends on EOS alone and spells the output; and the
masking benchmark's constrained requests all ran every timed step."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import run_script

pytestmark = [pytest.mark.ch13, pytest.mark.floors]
pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

SCRIPT = Path(__file__).parents[1] / "chapters" / "13_structured_outputs.py"
BATCH_SIZES, STEPS = [1, 3], 4


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ch13")
    args = ["--device", "cpu", "--samples", "1", "--max-tokens", "32", "--steps", str(STEPS),
            "--repeats", "1", "--batch-sizes", *map(str, BATCH_SIZES)]
    return run_script(SCRIPT, args, folder, "13_structured_outputs_cpu",
                      figures=("13_bitmask_steps", "13_validity", "13_whitespace", "13_mask_cost"))


def test_with_the_mask_nothing_breaks_its_format(payload):
    for name, modes in payload["validity"].items():
        free, held = modes["unconstrained"], modes["constrained"]
        assert held["invalid"] == 0, name
        assert sum(free.values()) == sum(held.values()) > 0 and free["cut"] == 0, name


def test_every_finished_json_fits_with_and_without_free_whitespace(payload):
    rates = payload["whitespace"]
    assert sorted(r["disable_any_whitespace"] for r in rates.values()) == [False, False, True, True]
    for label, r in rates.items():
        assert r["fits"] == r["finished"] <= r["requests"], label


def test_the_bitmask_picture_ends_on_eos_alone(payload):
    from minivllm import load_tokenizer

    picture = payload["bitmask"]
    tokens, counts = picture["tokens"], picture["allowed_per_step"]
    assert len(tokens) == len(counts) and min(counts) >= 1
    assert tokens[-1] == 0 and counts[-1] == 1, "after the closing brace, EOS is the only token allowed"
    assert load_tokenizer().decode(tokens, skip_special_tokens=True) == picture["text"]


def test_the_masking_benchmark_timed_full_batches(payload):
    rows = payload["mask_cost"]
    assert [r["batch_size"] for r in rows] == BATCH_SIZES
    for r in rows:
        assert r["constrained_finished_early"] == 0 and r["steps"] == STEPS
        assert r["plain_step_ms"] > 0 and r["constrained_step_ms"] > 0
        assert min(r["fill_us"], r["apply_us"], r["advance_us"]) > 0
