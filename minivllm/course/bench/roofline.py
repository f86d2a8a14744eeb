"""How fast could decoding possibly be? The memory roofline of a workload (chapter 9).

A decode step does little arithmetic per byte it reads: every step streams the whole model's
weights from memory once, and every sequence in it reads its whole cached context (its K and
V) once. So no engine can finish a workload faster than

    floor = (weight bytes x decode steps + KV bytes read) / memory bandwidth

and the share of that floor an engine reaches (floor / measured time) says how much of the
machine it uses. The bandwidth is measured, not taken from a datasheet: a device-to-device
copy, counting the bytes read and the bytes written. Published shares (nano-vllm's ~65 % on an
A100-40GB, vLLM's ~55 %) are priced at the *datasheet* bandwidth, which no copy reaches (an
H200's copy moves 4.1 TB/s of its 4.8), so every share here is also stated at the datasheet
figure (DATASHEET_BANDWIDTH, roofline_shares): compare like with like.

The model of the work, for a batch where every request decodes side by side:
- Weight reads: one per step, and there are as many steps as the longest output (the step
  that makes a request's first token is its prefill, which reads the weights too). Weight
  bytes are the parameters read per step: with tied embeddings the one matrix counts once
  (the LM head reads all of it); an untied embedding table does not count, because a step
  looks up only its own tokens' rows, a few kilobytes.
- KV reads: the step that makes a request's k-th token (k = 1 .. its output length) attends
  over its prompt and the k - 1 tokens it has made so far, reading prompt + k - 1 tokens of K
  and V. Over a request with prompt P and output N that is N*P + N*(N-1)/2 tokens.
Prefill arithmetic, the KV written, activations and the sampler are left out: the floor is a
bound, not a prediction.

The issue's numbers for the nano workload (Qwen3-0.6B shape, bf16, 3.0 TB/s): 1,024 weight
reads of 1.19 GB plus ~16 TB of KV, ~5.8 s, ~25,600 tok/s for ~149k output tokens. The same
sum on this project's seeded nano workload (`make_workload("nano", 151936, seed=0)`: 138,985
output tokens, the longest 1,024) gives 1,024 reads of 1.19 GB (1.22 TB) plus 14.0 TB of KV:
5.09 s, 27,300 tok/s. The sum is the same, the draw is not: ~149k output tokens is 7% more
than seed 0 draws, and KV reads grow with the square of the lengths. Over seeds 0-11 the
floor is 5.1-5.9 s and the ceiling 25,660-27,320 tok/s. The workload's expected value
(prompt and output lengths independent and uniform on 100-1024, as a 16 x 16 grid of lengths)
is 14.9 TB of KV plus 1.19 TB of weights, 5.38 s, 26,800 tok/s: the shared notes' "about
15 TB of KV reads plus 1.2 TB of weight reads", "roughly 26k output tok/s".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from minivllm.model import ModelConfig

# Datasheet memory bandwidth (bytes/s) of the GPUs this project has run on or compares with, by
# the name torch.cuda.get_device_name gives: the vendor's peak, which a copy never reaches.
# Sources: NVIDIA's H100 and H200 datasheets (H100 SXM 3.35 TB/s; H200 4.8 TB/s), the H100 PCIe
# product brief PB-11133-001 (2,000 GB/s), the A100 datasheet (40GB 1,555 GB/s; 80GB SXM
# 2,039 GB/s) and the GeForce RTX 4070 Laptop's specifications (16 Gbps GDDR6 on 128 bits: 256 GB/s).
DATASHEET_BANDWIDTH: dict[str, float] = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,  # the SXM5 part
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
    "NVIDIA A100-PCIE-40GB": 1.555e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA GeForce RTX 4070 Laptop GPU": 0.256e12,
}


def datasheet_bandwidth(device_name: str) -> float | None:
    """The datasheet bandwidth (bytes/s) of the GPU called `device_name`, or None for a device
    not in DATASHEET_BANDWIDTH (a CPU, a GPU this project has not priced)."""
    if not isinstance(device_name, str):
        raise ValueError(f"device_name must be a str, got {device_name!r}")
    return DATASHEET_BANDWIDTH.get(device_name)


@dataclass
class Floor:
    """The roofline floor of a workload: the bytes it must move and the time that takes."""

    weight_bytes: int  # read by one decode step
    weight_reads: int  # decode steps = the longest output
    kv_bytes: int  # K and V read by all decode steps of all requests
    bandwidth: float  # bytes/s
    output_tokens: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes * self.weight_reads + self.kv_bytes

    @property
    def seconds(self) -> float:
        return self.total_bytes / self.bandwidth

    @property
    def tokens_per_second(self) -> float:
        """The ceiling: output tokens per second at the floor."""
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict:
        return asdict(self) | dict(total_bytes=self.total_bytes, seconds=self.seconds,
                                   tokens_per_second=self.tokens_per_second)


def roofline_shares(floor: Floor, seconds: float, datasheet: float | None) -> dict[str, float | None]:
    """The share of the roofline a run of `seconds` reaches, twice: at the bandwidth the floor
    was priced at (measured), and at the datasheet bandwidth (None where there is none). The
    second is the first times measured / datasheet: the same run on a stricter yardstick."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
        raise ValueError(f"seconds must be a positive number, got {seconds!r}")
    if datasheet is not None and (not isinstance(datasheet, (int, float)) or isinstance(datasheet, bool)
                                  or not datasheet > 0):
        raise ValueError(f"datasheet must be a positive number of bytes/s or None, got {datasheet!r}")
    return dict(share_of_roofline=floor.seconds / seconds,
                share_of_datasheet_roofline=None if datasheet is None else floor.total_bytes / datasheet / seconds)


def element_size(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.tensor([], dtype=dtype).element_size()


def weight_bytes_per_step(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of parameters one decode step reads: all of them, except an untied embedding
    table, of which a step reads only its tokens' rows (see the module doc)."""
    untied_table = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return (config.num_parameters() - untied_table) * element_size(dtype)


def kv_tokens_read(prompt_len: int, output_len: int) -> int:
    """Cached tokens read by all the steps that make one request's output: the step making
    token k reads prompt_len + k - 1 tokens, for k = 1 .. output_len."""
    return output_len * prompt_len + output_len * (output_len - 1) // 2


def decode_floor(
    config: ModelConfig, dtype: torch.dtype, prompt_lens: list[int], output_lens: list[int], bandwidth: float
) -> Floor:
    """The roofline floor of decoding these requests side by side (see the module doc)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError(f"need one output length per prompt length, and at least one request; got "
                         f"{len(prompt_lens)} and {len(output_lens)}")
    for name, lens in (("prompt_lens", prompt_lens), ("output_lens", output_lens)):
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lens):
            raise ValueError(f"{name} must hold integers >= 1")
    if not isinstance(bandwidth, (int, float)) or isinstance(bandwidth, bool) or not bandwidth > 0:
        raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
    kv_tokens = sum(kv_tokens_read(p, n) for p, n in zip(prompt_lens, output_lens))
    return Floor(weight_bytes=weight_bytes_per_step(config, dtype), weight_reads=max(output_lens),
                 kv_bytes=kv_tokens * config.kv_bytes_per_token(dtype), bandwidth=float(bandwidth),
                 output_tokens=sum(output_lens))
