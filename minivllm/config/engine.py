"""The engine's settings, in one place: what `LLM(model, **settings)` and `LLMEngine` accept.

Each setting keeps vLLM's name and is checked here once, as strictly as a request is: a value of
the wrong type is refused like a value out of range, never converted. None means "choose for
this model on this device"; `resolve(model)` makes every such choice, so that the parts of the
engine (block manager, scheduler, model runner) only ever see decided values:

    setting                 None means                                   chapter
    max_num_batched_tokens  by the device, the table below                7
    max_num_seqs            by the device, the table below                7
    num_kv_blocks           what the memory budget holds                 6
    max_model_len           the model's context                          7
    attention               "triton" on a GPU with Triton, else "torch"  6, 8
    cuda_graphs             on with Triton attention on a GPU            9
    piecewise_graphs        on with cuda_graphs                          9
    fused_ops               on on a GPU with Triton                      9
    enable_prefix_caching   on, as in vLLM                               11
    speculative_config      off (None); a dict as vLLM's                 12
    disable_any_whitespace  on: JSON constraints without free whitespace 13
    tensor_parallel_size    (1: one process; never chosen for you)       14
    data_parallel_size      (1: one engine core; cores in processes)     14
    async_scheduling        on on a GPU (one process), off on a CPU      16
    persistent_batch        on: block tables kept in rows across steps   16
    kv_transfer_config      off (None); a dict as vLLM's                 17
    long_prefill_token_threshold  (0: off) most prompt tokens one request gets per step   7

The step's token budget and the number of requests running at once, by device, when the user
gives none (vLLM's table, EngineArgs.get_batch_defaults; vLLM has a second column for its
offline LLM class, shown in brackets, where minivllm uses its server's values everywhere):

    device                                        max_num_batched_tokens   max_num_seqs
    GPU with >= 70 GiB, not an A100 (H100, H200)  8,192  (LLM: 16,384)     1,024
    other GPUs (A100s included: a larger budget
      cost them throughput, vLLM PR #17885)       2,048  (LLM: 8,192)        256
    CPU                                           2,048  (vLLM: 2,048 x ranks, LLM 4,096)   256  (vLLM: 128, LLM 256)

A bigger budget on a big GPU is a first token sooner for a burst of users: 128 prompts of ~275
tokens need ~18 steps at 2,048 tokens each and ~5 at 8,192, at a cost a fast GPU hardly notices
per step. On a CPU every prompt token costs its share of the step, and 2,048 is what this course's
CPU numbers were measured with.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.config.kv_transfer import KVTransferConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.model import Decoder

# ---- the classroom: the engine as of the student's chapter ----
# A student copy (`minivllm exercises make`, course/exercises.py) lists in this file the chapters whose
# exercises are still stubs. A default that one of those chapters turned on is then what it was before
# that chapter, for every caller: LLM(), the server, notebooks, chapter scripts, and a core process,
# which reads this same module. So a student who has solved chapters 1..N-1 runs, everywhere, the engine
# those chapters built; an explicit setting (enable_prefix_caching=True) still wins. The repository
# itself has no such file: every chapter is built. (The checks use the same table the other way round:
# tests/conftest.py turns a later chapter's defaults off for an earlier chapter's checks.)
STUBBED_CHAPTERS_FILE = Path(__file__).with_name("stubbed_chapters.txt")


def stubbed_chapters(path: Path = STUBBED_CHAPTERS_FILE) -> frozenset[str]:
    """The chapters ("ch08", ...) whose exercises are stubs in this copy; none outside a student copy."""
    return frozenset(path.read_text().split()) if path.is_file() else frozenset()


def built(chapter: str) -> bool:
    """Whether this copy's engine has `chapter` (its exercises are solved)."""
    return chapter not in STUBBED


STUBBED = stubbed_chapters()
# Chapter 11's prefix caching is on unless asked otherwise, as in vLLM.
PREFIX_CACHING_DEFAULT = built("ch11")
# Chapter 13: JSON under a constraint is written without free whitespace unless a request asks
# for it. vLLM's default is the other way round; measured on the embedded model, free whitespace
# lets a small model write newlines until max_tokens (see README, chapter 13).
DISABLE_ANY_WHITESPACE_DEFAULT = True
# Chapter 16: the runner keeps block tables in rows across steps (worker/input_batch.py). Being a
# setting (not a switch in the runner's module), it travels with the config into a core process.
PERSISTENT_BATCH_DEFAULT = built("ch16")
# The defaults above that a chapter turned on: chapter -> (the name here, its value before that chapter).
# On a GPU, chapters 8, 9 and 16 also chose Triton attention, CUDA graphs, fused ops and async
# scheduling: `resolve` asks built() for those.
LATER_DEFAULTS = {"ch11": ("PREFIX_CACHING_DEFAULT", False), "ch16": ("PERSISTENT_BATCH_DEFAULT", False)}
GPU_KV_FRACTION = 0.8  # of the GPU memory still free once the model is loaded
CPU_KV_BYTES = 256 * 2**20  # a fixed KV budget on CPU, where "free memory" means little
ATTENTION_BACKENDS = ("torch", "triton")
log = logging.getLogger("minivllm.engine")


def check_setting(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """An engine setting that counts something: an int (not a bool, not a float that happens to
    be whole) of at least `minimum`, or None where that means "choose for me"."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def default_async_scheduling(device: torch.device) -> bool:
    """Chapter 16's overlap on a GPU, where the host works while the device computes. Off on a CPU,
    where the model runs on the host's own cores and there is nothing to overlap with."""
    return torch.device(device).type == "cuda"


def default_attention(device: torch.device) -> str:
    """Chapter 8's Triton kernels on a GPU when Triton is installed; chapter 6's PyTorch otherwise."""
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"


def default_batch_limits(device: torch.device) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) for `device`, by the table in the module doc."""
    if device.type == "cuda" and torch.cuda.is_available():  # (a stand-in "cuda" model in a CPU check: the small row)
        properties = torch.cuda.get_device_properties(device)
        if properties.total_memory >= 70 * 2**30 and "a100" not in properties.name.lower():
            return 8192, 1024
    return 2048, 256


def kv_blocks_for_memory(model: Decoder, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """How many KV blocks the memory budget holds (never more than max_num_seqs full-length
    sequences could use)."""
    bytes_per_block = model.config.kv_bytes_per_token(model.dtype) * block_size
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = int(GPU_KV_FRACTION * free)
    else:
        budget = CPU_KV_BYTES
    useful = max_num_seqs * -(-max_model_len // block_size)
    return max(1, min(budget // bytes_per_block, useful))


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (see the module doc). Made with bad values, it raises ValueError."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # blocks in the KV pool
    max_num_batched_tokens: int | None = None  # the token budget of one step (None: by the device)
    max_num_seqs: int | None = None  # requests running side by side (None: by the device)
    max_model_len: int | None = None  # the longest sequence, prompt and output together
    attention: str | None = None  # how paged attention reads the cache: "torch" or "triton"
    cuda_graphs: bool | None = None  # replay decode steps from CUDA graphs (CUDA only)
    piecewise_graphs: bool | None = None  # replay prompt-carrying steps from graphs cut at attention
    fused_ops: bool | None = None  # the token-wise work as fused Triton kernels
    enable_prefix_caching: bool | None = None  # share the KV blocks of common prefixes
    speculative_config: dict | SpeculativeConfig | None = None  # chapter 12: guess tokens, verify them in one pass
    disable_any_whitespace: bool | None = None  # JSON constraints: no free whitespace (a request may say otherwise)
    tensor_parallel_size: int = 1  # processes the model is split across (chapter 14)
    data_parallel_size: int = 1  # engine cores, each a whole copy of the model (chapter 14; served only)
    async_scheduling: bool | None = None  # chapter 16: plan step N+1 while step N runs on the device
    persistent_batch: bool | None = None  # chapter 16: block tables in rows kept across steps
    kv_transfer_config: dict | KVTransferConfig | None = None  # chapter 17: K/V to or from another instance
    long_prefill_token_threshold: int = 0  # most prompt tokens one request gets in a step (0: no cap)

    def __post_init__(self) -> None:
        for name, minimum, allow_none in (("block_size", 1, False), ("num_kv_blocks", 1, True),
                                          ("max_num_batched_tokens", 1, True), ("max_num_seqs", 1, True),
                                          ("long_prefill_token_threshold", 0, False),
                                          ("max_model_len", 2, True), ("tensor_parallel_size", 1, False),
                                          ("data_parallel_size", 1, False)):
            check_setting(name, getattr(self, name), minimum, allow_none)
        if self.attention is not None and self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention!r}; choose from {', '.join(ATTENTION_BACKENDS)}")
        for name in ("cuda_graphs", "piecewise_graphs", "fused_ops"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None (automatic), got {value!r}")
        for name in ("enable_prefix_caching", "disable_any_whitespace", "async_scheduling", "persistent_batch"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None (the default), got {value!r}")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} with tensor_parallel_size="
                             f"{self.tensor_parallel_size} is not supported: copies of a model that itself needs "
                             "splitting would be data_parallel_size x tensor_parallel_size processes, each group with "
                             "its own rendezvous; choose one (splits for a model that does not fit one device, "
                             "copies for one that does)")
        if self.speculative_config is not None:  # frozen: normalise the user's dict once, here
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.kv_transfer_config is not None:  # chapter 17; rank 0's pool alone is not a block's K/V under TP
            object.__setattr__(self, "kv_transfer_config", KVTransferConfig.from_dict(self.kv_transfer_config))
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_transfer_config needs tensor_parallel_size=1: each rank holds only its own KV heads")

    @classmethod
    def from_settings(cls, **settings: Any) -> EngineConfig:
        """EngineConfig(**settings), refusing a name that is not a setting with a ValueError
        that lists the ones there are (a misspelt switch must not be silently ignored)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise ValueError(f"unknown engine setting{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
                             f"the settings are: {', '.join(names)}")
        return cls(**settings)

    def resolve(self, model: Decoder) -> EngineConfig:
        """A copy with every None decided for `model` on its device, checked against the model
        (max_model_len within its context; CUDA graphs only on CUDA)."""
        context = model.config.max_position_embeddings
        max_model_len = self.max_model_len or context
        if not 1 < max_model_len <= context:
            raise ValueError(f"max_model_len must be in [2, {context}] (the model's context), got {max_model_len}")
        on_gpu = model.device.type == "cuda"
        default_tokens, default_seqs = default_batch_limits(model.device)
        max_num_batched_tokens = self.max_num_batched_tokens or default_tokens  # the user's value wins
        max_num_seqs = self.max_num_seqs or default_seqs
        if self.tensor_parallel_size > 1:  # chapter 14: the model must split evenly, one GPU per rank
            from minivllm.distributed.shard import check_shardable

            check_shardable(model.config, self.tensor_parallel_size)
            if on_gpu and self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs one GPU per rank; "
                                 f"this machine has {torch.cuda.device_count()}")
        attention = self.attention or default_attention(model.device)
        if self.attention is None and attention == "triton" and not built("ch08"):  # the classroom, above
            attention = "torch"
        if self.cuda_graphs and not on_gpu:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {model.device}")
        cuda_graphs = self.cuda_graphs if self.cuda_graphs is not None else (
            on_gpu and attention == "triton" and built("ch09"))
        if cuda_graphs and attention == "torch":
            # A graph fixes every shape at capture, so chapter 6's decode would gather the longest
            # context the engine allows for every row of the largest batch, in every layer.
            gathered = max_num_seqs * max_model_len * model.config.kv_bytes_per_token(model.dtype)
            gathered //= model.config.num_layers
            raise ValueError(
                f"cuda_graphs=True needs attention='triton': inside a captured graph attention='torch' gathers "
                f"max_model_len={max_model_len:,} tokens of K and V for each of max_num_seqs={max_num_seqs} rows, "
                f"{gathered / 2**30:,.1f} GiB per layer. Use attention='triton' (the default on a GPU) or cuda_graphs=False.")
        if self.piecewise_graphs and not cuda_graphs:
            raise ValueError("piecewise_graphs=True needs cuda_graphs: the pieces share the decode graphs' memory pool "
                             "and are captured beside them; turn cuda_graphs on or piecewise_graphs off")
        piecewise_graphs = cuda_graphs if self.piecewise_graphs is None else self.piecewise_graphs
        fused_ops = self.fused_ops if self.fused_ops is not None else (
            on_gpu and importlib.util.find_spec("triton") is not None and built("ch09"))
        prefix_caching = PREFIX_CACHING_DEFAULT if self.enable_prefix_caching is None else self.enable_prefix_caching
        no_whitespace = self.disable_any_whitespace
        if no_whitespace is None:
            no_whitespace = DISABLE_ANY_WHITESPACE_DEFAULT
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling=True needs tensor_parallel_size=1: the other ranks receive a plan "
                             "whose input ids are all known on the host")
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = (default_async_scheduling(model.device) and self.tensor_parallel_size == 1
                                and built("ch16"))
        persistent_batch = PERSISTENT_BATCH_DEFAULT if self.persistent_batch is None else self.persistent_batch
        num_kv_blocks = self.num_kv_blocks
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_for_memory(model, self.block_size, max_num_seqs, max_model_len)
            mib = num_kv_blocks * self.block_size * model.config.kv_bytes_per_token(model.dtype) / 2**20
            log.info("KV cache: %s blocks × %d tokens = %s tokens, %s MiB on %s", f"{num_kv_blocks:,}",
                     self.block_size, f"{num_kv_blocks * self.block_size:,}", f"{mib:,.0f}", model.device)
        return dataclasses.replace(self, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, attention=attention,
                                   cuda_graphs=cuda_graphs, piecewise_graphs=piecewise_graphs, fused_ops=fused_ops,
                                   enable_prefix_caching=prefix_caching,
                                   disable_any_whitespace=no_whitespace, async_scheduling=async_scheduling,
                                   persistent_batch=persistent_batch)
