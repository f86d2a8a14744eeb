"""Turn one step's schedule into a forward pass (chapter 7; made lean in chapter 9).

The scheduler speaks in requests and token counts; the model speaks in flat tensors. The
runner translates: it lays out every scheduled token side by side (`input_ids`, `positions`),
describes the layout for paged attention (`PagedBatch`: who owns which tokens, where their K
and V go, which blocks hold their past), runs the model once, and computes logits only for
the sequences whose computation reached their last token this step: a prefill chunk that
stops mid-prompt has nothing to predict yet.

Chapter 9 changes how, not what: the inputs are built with NumPy and reach the device in one
non-blocking copy (prepare.py), decode steps can replay CUDA graphs (cuda_graphs.py), steps that
carry prompt tokens can replay graphs cut at attention (piecewise_graphs.py), and the token-wise
work can run as fused Triton kernels (fused/). Each sits behind a switch; `graphs_for` is the one
rule that says which graphs a step replays.

Chapter 14 splits a step in two: `run` plans it on the host (a `StepPlan`: the step's arrays,
nothing but numbers) and `execute` runs a plan on the device. Under tensor parallelism only
rank 0 plans; the plan is the message the other ranks receive, and every rank executes it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from minivllm.attention import paged_attention_class
from minivllm.attention.paged import KVPool
from minivllm.config.engine import EngineConfig
from minivllm.kv_transfer import KVConnectorRole, make_connector
from minivllm.model import Decoder
from minivllm.request.sequence import SchedulerOutput
from minivllm.worker.cuda_graphs import GraphRunner, bucket_for
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.piecewise_graphs import PiecewiseRunner
from minivllm.worker.prepare import (
    StepArrays,
    build_step_arrays,
    device_step,
    to_device,
)
from minivllm.worker.sampled_tokens import SampledTokens


@dataclass
class StepPlan:
    """One step as the model runs it, on the host: numbers only, nothing tied to a device or to
    the scheduler's requests (chapter 14 sends it from rank 0 to the other ranks)."""

    arrays: StepArrays  # the step's inputs; for a replay, padded to graph_size sequences of equal rows
    num_seqs: int  # the step's real sequences (rows 0 .. num_seqs-1)
    graph_size: int | None = None  # the batch-size bucket whose CUDA graph replays the step; None: eager
    piece_size: int | None = None  # the token-count bucket whose pieces replay the step (piecewise_graphs.py)
    prompt_rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # sequence -> its rows, for prompt logprobs


class ModelRunner:
    """Runs the model the way `config` (resolved: no None left) says: its attention backend,
    fused ops or not, CUDA graphs or not, on a KV pool of config.num_kv_blocks blocks. The graphs
    follow the model's device: CudaGraph on CUDA; on a CPU, where tests force cuda_graphs=True,
    EagerGraph stands in (graph_class overrides that choice). graph_query_lens: the query lengths
    captured (cuda_graphs.py); None: 1, and 1 + k for speculation's verify steps."""

    def __init__(self, model: Decoder, config: EngineConfig, graph_class: type | None = None,
                 graph_query_lens: tuple[int, ...] | None = None):
        self.model = model
        # Checked before the pool is allocated: an attention backend that cannot run here fails at once.
        self.attention_class = paged_attention_class(config.attention, model.device, model.dtype)
        self.forward: Callable[..., torch.Tensor] = model
        if config.fused_ops:
            from minivllm import fused

            fused.check_fused_ops(model.device, model.dtype)
            fused.merge_projections(model)  # one GEMM for q/k/v and one for gate/up; weights become views, not copies
            self.forward = lambda ids, positions, attention: fused.fused_forward(model, ids, positions, attention)
        # One block more than the block manager hands out: the rows that pad a CUDA graph's
        # batch read and write that one, so they never touch a request's cache.
        self.pool = KVPool(model, config.num_kv_blocks + 1, config.block_size)
        self.connector = make_connector(config, model, KVConnectorRole.WORKER)  # chapter 17 (None: off)
        # Chapter 16: block tables in rows that persist across steps, written only where they change
        # (speculation's rollback can change them anywhere past its cut: compared whole then).
        self.batch = None
        if config.persistent_batch:
            self.batch = InputBatch(config.max_num_seqs, -(-config.max_model_len // config.block_size),
                                    config.block_size, model.device, rollback=config.speculative_config is not None)
        self.graphs = None
        if config.cuda_graphs:
            spec = config.speculative_config
            query_lens = graph_query_lens or ((1,) if spec is None else (1, 1 + spec.num_speculative_tokens))
            with torch.inference_mode():
                self.graphs = GraphRunner(self.forward, self.pool, self.attention_class, config.max_num_seqs,
                                          config.max_model_len, graph_class, query_lens)
        self.pieces = None
        if config.piecewise_graphs:
            with torch.inference_mode():  # CUDA graphs on CUDA, the stand-in elsewhere (as for the decode graphs)
                self.pieces = PiecewiseRunner(self.forward, model.device, config.max_num_batched_tokens,
                                              self.pool.k.device.type == "cuda",
                                              self.graphs.memory_pool if self.graphs is not None else None)

    def graphs_for(self, num_new_tokens: list[int]) -> tuple[bool, int | None]:
        """The one rule for which graphs replay a step: the decode graphs if it fits one (one token
        per sequence, or chapter 12's verify chunks); else the pieces of the smallest token-count
        bucket that holds it; else none (eager). Returns (decode graph?, piece bucket or None)."""
        if self.graphs is not None and self.graphs.can_run(num_new_tokens):
            return True, None
        if self.pieces is not None:
            return False, self.pieces.bucket_for(sum(num_new_tokens))
        return False, None

    @torch.inference_mode()
    def run(self, schedule: SchedulerOutput, previous: SampledTokens | None = None
            ) -> tuple[list[int], torch.Tensor, dict[int, torch.Tensor]]:
        """Run the scheduled tokens. Returns the indices (into schedule.seqs) of the sequences
        that produce a token this step, their logits [len(indices), vocab], and the logits of
        every token computed this step [num_new_tokens, vocab] (row j predicts the token after
        it) for each sequence whose request asked for prompt logprobs and computed prompt
        tokens, keyed by its index. previous (chapter 16, async scheduling): the last step's
        tokens, still on the device, which this step's placeholders stand for."""
        seqs, num_new = schedule.seqs, schedule.num_new_tokens
        replay, piece_size = self.graphs_for(num_new)
        with record_function("prepare"):
            if replay and self.batch is None:  # padded to a captured batch size (and query length), in the graphs' static buffers
                graph_size, arrays, flat = self.graphs.prepare_step(seqs, num_new)
            elif replay:  # the same, from the persistent batch's rows
                graph_size, query_len = bucket_for(len(seqs), self.graphs.sizes), self.graphs.query_len_for(num_new)
                arrays = self.batch.step_arrays(seqs, num_new, graph_size, self.graphs.pad_block,
                                                None if query_len == 1 else query_len)
                flat = self.graphs.load(arrays)
            elif self.batch is None:
                graph_size, arrays = None, build_step_arrays(seqs, num_new, self.pool.block_size)
                flat = to_device(arrays.pack(), self.model.device)
            else:
                graph_size, arrays = None, self.batch.step_arrays(seqs, num_new)
                flat = self.batch.to_device(arrays.pack())
            if previous is not None:
                previous.feed(seqs, arrays, flat)
            prompt_rows = {i: (int(arrays.query_start[i]), int(arrays.query_start[i]) + num_new[i])
                           for i, seq in enumerate(seqs)
                           if seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens}
        if self.connector is not None:  # chapter 17: K/V another instance computed, into this step's blocks
            self.connector.load_kv(schedule.kv_connector_metadata, self.pool)
        result = self.execute(StepPlan(arrays, len(seqs), graph_size, piece_size, prompt_rows), flat)
        if self.connector is not None:  # chapter 17: and the K/V this step computed, out for another
            self.connector.save_kv(self.pool)
        return result

    @torch.inference_mode()
    def execute(self, plan: StepPlan, flat: torch.Tensor | None = None
                ) -> tuple[list[int], torch.Tensor, dict[int, torch.Tensor]]:
        """Run a planned step; returns what `run` returns. `flat`: the plan's packed inputs
        already on the device (in the graphs' static buffer for a replay), as `run` leaves them;
        None (a rank that received the plan, chapter 14) copies them there first."""
        arrays, replay = plan.arrays, plan.graph_size is not None
        with record_function("prepare"):
            if replay:
                if flat is None:
                    flat = self.graphs.load(arrays)
                sample_rows = arrays.unpack(flat)["sample_rows"]
            else:
                if flat is None:
                    flat = to_device(arrays.pack(), self.model.device)
                step = device_step(arrays, flat)
                sample_rows = step.sample_rows
                attention = self.attention_class(self.pool, step.batch)
        with record_function("forward"):
            if replay:
                hidden = self.graphs.replay(plan.graph_size, plan.num_seqs)  # the real sequences' rows
            elif plan.piece_size is not None:
                hidden = self.pieces.replay(plan.piece_size, step.input_ids, step.positions, attention)
            else:
                hidden = self.forward(step.input_ids, step.positions, attention)
            # Logits only for the rows that predict a token (the lm_head is the largest matmul).
            everyone = replay and len(arrays.sample_rows) == len(hidden)  # every row, in order
            logits = self.model.lm_head(hidden if everyone else hidden[sample_rows])
            prompt_logits = {i: self.model.lm_head(hidden[start:end]) for i, (start, end) in plan.prompt_rows.items()}
        return arrays.samplers, logits, prompt_logits
