"""Timing what runs on a device: host clocks around synchronised work, CUDA events, CUDA
graph replays, and the memory bandwidth every roofline is measured against.

A GPU runs asynchronously: a Python call returns when the work is *queued*. So a wall-clock
time of GPU work needs a synchronisation at both ends (machine.synchronize), and a kernel's
own time is best taken with CUDA events, which the GPU records as it passes them.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch

from minivllm.course.bench.harness import console
from minivllm.machine import synchronize


def time_stream(tokens: Iterator[int], device: torch.device) -> list[float]:
    """Seconds each token of a token stream took to appear (device synchronised)."""
    times, last = [], time.perf_counter()
    for _ in tokens:
        synchronize(device)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def cuda_seconds(fn: Callable[[], Any], warmup: int = 10, iters: int = 40) -> float:
    """Median seconds per call, timed with CUDA events. The L2 cache (50 MB on an H100) is
    flushed before each call, so small problems are not served from cache."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def replayable(fn: Callable[[], Any]) -> tuple[Callable[[], Any], str]:
    """(the replay of a CUDA graph holding one call of fn, "graph"), or (fn, "eager") where fn
    cannot be captured. Timing a replay measures the GPU's work without the host's cost of
    launching each kernel (tens of microseconds for a Triton launch from Python), which is how
    the engine runs decode steps from chapter 9 on; the L2 flush before each call leaves the
    host time to queue the replay before the GPU gets to it."""
    try:
        stream = torch.cuda.Stream()  # warm up (compile, allocate) outside the graph, as PyTorch asks
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, "graph"
    except Exception as error:  # e.g. an operation that synchronises, which a graph cannot hold
        torch.cuda.synchronize()
        console.print(f"[yellow]  could not capture a call in a CUDA graph ({type(error).__name__}); timed eagerly")
        return fn, "eager"


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting the bytes read and the
    bytes written (2 x nbytes per copy); the median of `repeats` timed copies after one
    untimed. nbytes (default 1 GiB on a GPU, 256 MiB on a CPU) must be far larger than the
    caches, or the copy measures them instead of memory. GPU copies are timed with CUDA events."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    nbytes = nbytes if nbytes is not None else (2**30 if device.type == "cuda" else 2**28)
    for name, value in (("nbytes", nbytes), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocation are not bandwidth
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            start_time = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - start_time)
    return 2 * nbytes / statistics.median(seconds)


def read_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 10) -> float:
    """Measured read bandwidth in bytes/s: a sum over nbytes (default 1 GiB on a GPU, 256 MiB on a
    CPU) reads every byte once and writes one number, the median of `repeats` timed sums after
    one untimed. A copy also writes what it reads, and on a GPU reading alone runs a few percent
    faster (SDPA decode reads K/V at 101-105 % of the copy rate on an H200): a roofline floor
    priced at the copy rate alone would overstate the share of it an engine reaches."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    nbytes = nbytes if nbytes is not None else (2**30 if device.type == "cuda" else 2**28)
    for name, value, least in (("nbytes", nbytes, 4), ("repeats", repeats, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    src.sum()  # first touch and kernel selection are not bandwidth
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        src.sum()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return src.numel() * 4 / statistics.median(seconds)


def floor_bandwidth(device: torch.device | str) -> dict[str, float]:
    """The rate a roofline floor is priced at: the highest of the copy rate (read + write bytes)
    and the read rate measured here, both kept so a reader sees which one set it."""
    copy, read = copy_bandwidth(device), read_bandwidth(device)
    return dict(copy=copy, read=read, floor=max(copy, read))
