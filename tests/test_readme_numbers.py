"""The README's measured numbers are the committed results files' numbers.

The rule: a number the README attributes to a file in benchmarks/results/ is listed here as a
claim, the README's words with "{}" where the numbers go and, for each, where it is in the file
(a path of keys and list indexes) and how the README writes it. A claim holds when the README
contains its words with the file's numbers filled in (whitespace collapsed, so a claim may
span a line break). So a rerun committed without updating the README fails here, and so does a
README edit that changes a number without its file. A claim whose words the README no longer
contains fails too: remove it here when the README drops the sentence.

Covered: chapter 9's roofline on the H200 (also quoted in chapter 16), chapter 15 on this
course's CPU and on the H200, chapter 16 on the CPU's stand-in device and on the H200, the burst
of issue 48 on the CPU, chapter 17's streams beside long prompts on the CPU.
"""
from __future__ import annotations

import difflib
import gzip
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
Key = tuple[str | int, ...]


@dataclass(frozen=True)
class Claim:
    """`text` with one "{}" per entry of `values`: (path in `file`, format, scale)."""

    text: str
    file: str
    values: tuple[tuple[Key, str, float], ...]


def number(key: Key, fmt: str, scale: float = 1.0) -> tuple[Key, str, float]:
    return key, fmt, scale


@cache
def results(name: str) -> Any:
    path = RESULTS / name
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def lookup(data: Any, key: Key) -> Any:
    for part in key:
        data = data[part]
    return data


def collapse(text: str) -> str:
    return re.sub(r"\s+", " ", text)


ROOFLINE, ROOFLINE_2048 = "09_roofline_cuda.json", "09_roofline_cuda_budget2048.json"
CH15_CPU, CH15_GPU = "15_core_process_cpu.json", "15_serving_gpu.json"
CH16_CPU, CH16_GPU = "16_async_scheduling_cpu.json", "16_async_scheduling_cuda.json.gz"
ONE, SPLIT = "one process (ch10)", "core process (ch15)"
BURST, CH17_CPU = "48_burst_ttft_cpu.json", "17_disaggregated_prefill_cpu.json"
FAST_HTTP = "48_frontend_cpu_uvloop.json"


DATASHEET_H200 = 4.8e12  # bytes/s: the README's second yardstick for the committed H200 run


def roofline_cells(i: int) -> tuple[tuple[Key, str, float], ...]:
    """A row of chapter 9's table: seconds, tok/s, the share at the measured bandwidth and at the
    H200's datasheet bandwidth (the same share times measured / datasheet: the file's bandwidth)."""
    measured = results(ROOFLINE)["bandwidth"]["bytes_per_second"]
    return (number(("rows", i, "median_seconds"), "{:.2f}"), number(("rows", i, "tokens_per_second"), "{:,.0f}"),
            number(("rows", i, "share_of_roofline"), "{:.1f}", 100),
            number(("rows", i, "share_of_roofline"), "{:.1f}", 100 * measured / DATASHEET_H200))


def ch15_cpu_rows() -> list[Claim]:
    """README's chapter-15 CPU table, one claim per row: both servers' tok/s, TPOT p50, ITL p50, TTFT p99."""
    claims = []
    for i, users in enumerate((1, 8, 32, 128)):
        cells: list[tuple[Key, str, float]] = []
        for server in (ONE, SPLIT):
            run = ("runs", "concurrency", server, "levels", i)
            cells += [number(run + ("output_throughput",), "{:,.0f}"), number(run + ("tpot", "p50"), "{:.1f}", 1e3),
                      number(run + ("itl", "p50"), "{:.1f}", 1e3), number(run + ("ttft", "p99"), "{:,.0f}", 1e3)]
        claims.append(Claim(f"| {users} | {{}} | {{}} ms | {{}} ms | {{}} ms | {{}} | {{}} ms | {{}} ms | {{}} ms |",
                            CH15_CPU, tuple(cells)))
    return claims


def ch15_gpu_rows() -> list[Claim]:
    """README's chapter-15 H200 table: tok/s, TTFT p99, TPOT p50 of chapter 10; tok/s, TTFT p99,
    TPOT p50 / p99 of the core process (the two highest throughputs in bold)."""
    claims = []
    for i, users in enumerate((1, 8, 32, 128, 256)):
        one, split = ("runs", ONE, i), ("runs", SPLIT, i)
        bold = "**" if users >= 128 else ""
        claims.append(Claim(
            f"| {users} | {{}} | {{}} ms | {{}} ms | {bold}{{}}{bold} | {{}} ms | {{}} / {{}} ms |", CH15_GPU, (
                number(one + ("output_throughput",), "{:,.0f}"), number(one + ("ttft", "p99"), "{:,.0f}", 1e3),
                number(one + ("tpot", "p50"), "{:.1f}", 1e3), number(split + ("output_throughput",), "{:,.0f}"),
                number(split + ("ttft", "p99"), "{:,.0f}", 1e3), number(split + ("tpot", "p50"), "{:.1f}", 1e3),
                number(split + ("tpot", "p99"), "{:.1f}", 1e3))))
    return claims


def ch16_cpu_rows() -> list[Claim]:
    """README's stand-in table: device, host, synchronous, host + device, async, max(host, device)."""
    columns = ("device_ms", "host_ms", "sync_ms", "host_plus_device_ms", "async_ms", "max_host_device_ms")
    return [Claim("| {} | {} | {} | {} | {} | {} |", CH16_CPU,
                  tuple(number(("stand_in", "rows", i, c), "{:.2f}") for c in columns)) for i in range(4)]


def burst_rows() -> list[Claim]:
    """The burst table (issue 48): TTFT p50 and p99 and when the burst was done, per setting."""
    return [Claim(f"| {label} | {{}} ms | {{}} ms | {{}} s |", BURST, (
        number(("medians", setting, "ttft_p50"), "{:,.0f}", 1e3), number(("medians", setting, "ttft_p99"), "{:,.0f}", 1e3),
        number(("medians", setting, "seconds"), "{:.2f}"))) for setting, label in (
            ("budget 2048", "budget 2,048 (before)"), ("budget 8192", "budget 8,192 (the big-GPU default now)"),
            ("budget 2048, cap 128", "budget 2,048, cap 128 tokens per prompt per step"))]


def ch17_itl_rows() -> list[Claim]:
    """Chapter 17's table: the streams' ITL p50 / p90 / p99 / mean, their TTFT p50 / p99 and the long
    prompts' TTFT p50 / p99, per setup (medians over the rounds)."""
    claims = []
    for setup in ("one engine", "disaggregated, files", "disaggregated, ZMQ"):
        at = ("itl_under_long_prompts", "setups", setup, "medians")
        itl, ttft, long = at + ("stream_itl_ms",), at + ("stream_ttft_ms",), at + ("long_ttft_ms",)
        claims.append(Claim(f"| {setup} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} |", CH17_CPU, (
            number(itl + ("p50",), "{:.1f}"), number(itl + ("p90",), "{:,.0f}"), number(itl + ("p99",), "{:,.0f}"),
            number(itl + ("mean",), "{:.1f}"), number(ttft + ("p50",), "{:,.0f}"), number(ttft + ("p99",), "{:,.0f}"),
            number(long + ("p50",), "{:,.0f}"), number(long + ("p99",), "{:,.0f}"))))
    return claims


CLAIMS: list[Claim] = [
    # Chapter 9: the roofline on the H200, at the measured bandwidth and at the datasheet's.
    Claim("the floor is {} s at the measured copy bandwidth ({} TB/s", ROOFLINE,
          (number(("floor", "seconds"), "{:.2f}"), number(("bandwidth", "copy_bytes_per_second"), "{:.2f}", 1e-12))),
    *(Claim(f"| {setting} | {{}} | {{}} | {{}} % | {{}} % |", ROOFLINE, roofline_cells(i)) for i, setting in (
        (0, "graphs + pieces + fused + async (the default on a GPU)"), (1, "decode graphs only + fused + async"),
        (2, "graphs + pieces + fused, synchronous (chapter 9's step)"), (4, "graphs + pieces, synchronous"),
        (5, "eager"))),
    Claim("was 4 % *slower* ({} against {})", ROOFLINE,
          (number(("rows", 0, "tokens_per_second"), "{:,.0f}"), number(("rows", 1, "tokens_per_second"), "{:,.0f}"))),
    Claim("the default engine went from {} (decode graphs only) to {} tok/s", ROOFLINE_2048,
          (number(("rows", 1, "tokens_per_second"), "{:,.0f}"), number(("rows", 0, "tokens_per_second"), "{:,.0f}"))),
    # Chapter 16: the same file, and the step on the H200.
    Claim("takes the default engine from {} s to {} s", ROOFLINE,
          (number(("rows", 2, "median_seconds"), "{:.2f}"), number(("rows", 0, "median_seconds"), "{:.2f}"))),
    # Chapter 15 on this course's CPU.
    Claim("offline {} tok/s with a step at batch ~128 of {} ms", CH15_CPU,
          (number(("chapter15", "offline", "output_throughput"), "{:,.0f}"),
           number(("chapter15", "offline", "step_seconds_p50_full_batch"), "{:.1f}", 1e3))),
    Claim("Served at 128 streams / offline: **{}** (one process) and **{}** (core process)", CH15_CPU,
          (number(("chapter15", "servers", ONE, "fraction_of_offline_at_max_users"), "{:.2f}"),
           number(("chapter15", "servers", SPLIT, "fraction_of_offline_at_max_users"), "{:.2f}"))),
    *ch15_cpu_rows(),
    # Chapter 15 on the H200.
    *ch15_gpu_rows(),
    # Chapter 16 on the CPU's stand-in device and on the H200.
    *ch16_cpu_rows(),
    Claim("the overlapped engine measures less host time for the same work ({}, {}, {} and {} ms in the same file)",
          CH16_CPU, tuple(number(("stand_in", "rows", i, "async_host_ms"), "{:.2f}") for i in range(4))),
    Claim("synchronous {} ms for {} ms of GPU work (**{}×**), async scheduling **{} ms for {} ms ({}×)**", CH16_GPU,
          (number(("gpu", "sync", "plain_step_ms"), "{:.2f}"), number(("gpu", "sync", "device_busy_ms"), "{:.2f}"),
           number(("gpu", "sync_step_over_busy"), "{:.2f}"), number(("gpu", "async", "plain_step_ms"), "{:.2f}"),
           number(("gpu", "async", "device_busy_ms"), "{:.2f}"), number(("gpu", "async_step_over_busy"), "{:.3f}"))),
    # Issue 48: the frontend's CPU per token without and with uvicorn's C HTTP path; the burst of 128 requests.
    Claim("gives **{} → {} µs per token**", FAST_HTTP,
          (number(("medians", "compare", "frontend_us_per_token"), "{:.1f}"),
           number(("medians", "this", "frontend_us_per_token"), "{:.1f}"))),
    *burst_rows(),
    # Chapter 17: decode streams beside long prompts, one engine against two instances, on the CPU.
    *ch17_itl_rows(),
]


def expected(claim: Claim) -> str:
    data = results(claim.file)
    return claim.text.format(*(fmt.format(lookup(data, key) * scale) for key, fmt, scale in claim.values))


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c.file}:{c.text[:40]}" for c in CLAIMS])
def test_readme_quotes_the_results_file(claim):
    assert claim.text.count("{}") == len(claim.values), "a claim has one {} per number"
    assert (RESULTS / claim.file).is_file(), f"the README quotes {claim.file}, which is not committed"
    lines = (ROOT / "README.md").read_text().splitlines()
    text = collapse(expected(claim))
    if text not in collapse("\n".join(lines)):
        # Show the README's nearest passage: a line, or two joined (a claim may span a line break).
        windows = [collapse(" ".join(lines[i:i + 2])) for i in range(len(lines))]
        nearest = difflib.get_close_matches(text, windows, n=1, cutoff=0.0)
        pytest.fail(f"README should say {text!r} (numbers from benchmarks/results/{claim.file}); the nearest it "
                    f"says is {nearest[0] if nearest else ''!r}")


def test_every_results_file_the_readme_names_is_committed():
    named = set(re.findall(r"benchmarks/results/([\w.-]+\.json(?:\.gz)?)", (ROOT / "README.md").read_text()))
    missing = sorted(name for name in named if not (RESULTS / name).is_file())
    assert not missing, f"the README names results files that are not committed: {missing}"
