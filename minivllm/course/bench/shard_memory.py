"""Chapter 14 — how much memory one rank needs to load its shard, before and after direct loading.

Each measurement is a fresh process that loads rank r's shard of N and reports the peak of its
resident memory above its baseline (Linux: /proc/self/clear_refs resets the peak, VmHWM reads it),
or with --device cuda the peak of the GPU memory torch allocated (max_memory_allocated):

    cut     the whole model (load_model), then its shard cut from it (shard.shard_decoder): what
            chapter 14 first did on rank 0
    direct  only the shard's slices, read from the checkpoint or drawn (direct_load.load_shard)

    python -m minivllm.course.bench.shard_memory [--config minivllm/configs/NAME.json] [--sizes 1 2 4] [--device cuda]

No process group is needed: a rank's shard is built from its rank and N alone, so one GPU can
measure what each of N GPUs would hold.

A safetensors checkpoint is memory-mapped: the pages of the file a rank touches count in its
resident memory too (shared with every other process, the operating system's page cache), so the
default measures a config-only model, whose weights are drawn in the process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minivllm.distributed.direct_load import load_shard
from minivllm.distributed.layers import Communicator
from minivllm.distributed.shard import shard_decoder
from minivllm.loader import load_model, open_weights
from minivllm.model import Decoder

# ~270 MB of fp32 weights: the weights, not torch's libraries, decide the peak.
DEFAULT_SHAPE = dict(model_type="qwen3", vocab_size=32768, hidden_size=1024, intermediate_size=3072,
                     num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                     max_position_embeddings=1024, tie_word_embeddings=False)


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_here(source: str, how: str, rank: int, n: int, device: str = "cpu") -> dict[str, Any]:
    """In this process: load rank `rank` of `n` (how: "cut" or "direct") on `device` (fp32 on a
    CPU, bf16 on CUDA); the peak above the baseline, the bytes the shard holds, the seconds taken."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    open_weights(source)  # transformers' import, before the baseline
    if device == "cpu":
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    else:
        torch.cuda.init()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if how == "direct":
        model = load_shard(open_weights(source, device), Communicator(rank, n), device, dtype)
    else:
        model = shard_decoder(load_model(source, device, dtype), Communicator(rank, n))
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") if device == "cpu" else torch.cuda.max_memory_allocated()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(how=how, rank=rank, world_size=n, peak_bytes=peak - base, held_bytes=held, seconds=seconds)


def measure(source: str, how: str, rank: int, n: int, device: str) -> dict[str, Any]:
    """measure_here in a fresh process."""
    out = subprocess.run([sys.executable, "-m", "minivllm.course.bench.shard_memory", "--child", source, how, str(rank),
                          str(n), "--device", device], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def weight_bytes(source: str, dtype: torch.dtype) -> int:
    with torch.device("meta"):
        return sum(p.numel() * dtype.itemsize for p in Decoder(open_weights(source).config).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--config", help="a config.json (default: a ~270 MB Qwen3-shaped model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/14_shard_memory_{device}.json")
    args = parser.parse_args()
    if args.child:
        source, how, rank, n = args.child
        print(json.dumps(measure_here(source, how, int(rank), int(n), args.device)))
        return
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    out = args.out or f"benchmarks/results/14_shard_memory_{args.device}.json"
    with tempfile.TemporaryDirectory() as folder:
        source = args.config or str(Path(folder) / "config.json")
        if not args.config:
            Path(source).write_text(json.dumps(DEFAULT_SHAPE))
        weights = weight_bytes(source, dtype)
        rows = []
        for n in args.sizes:
            for how in ("cut", "direct"):
                for rank in sorted({0, n - 1}):
                    row = measure(source, how, rank, n, args.device)
                    row["peak_over_weights"] = row["peak_bytes"] / weights
                    rows.append(row)
                    print(f"N={n} rank {rank} {how:6s}: peak {row['peak_bytes'] / 2**20:7.0f} MiB = "
                          f"{row['peak_over_weights']:.2f}x the weights (holds {row['held_bytes'] / 2**20:.0f} MiB), "
                          f"{row['seconds']:.1f} s")
        shape = json.loads(Path(source).read_text())
    machine = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__) if args.device == "cuda" else {}
    result = dict(device=args.device, dtype=str(dtype).removeprefix("torch."), model_shape=shape, weight_bytes=weights,
                  loadavg=os.getloadavg(), machine=machine, command=" ".join(["python -m minivllm.course.bench.shard_memory",
                                                                             *sys.argv[1:]]), rows=rows)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
