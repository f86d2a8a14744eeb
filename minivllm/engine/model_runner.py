"""Turn one step's schedule into a forward pass (chapter 7).

The scheduler speaks in requests and token counts; the model speaks in flat tensors. The
runner translates: it lays out every scheduled token side by side (`input_ids`, `positions`),
describes the layout for paged attention (`PagedBatch`: who owns which tokens, where their K
and V go, which blocks hold their past), runs the model once, and computes logits only for
the sequences whose computation reached their last token this step: a prefill chunk that
stops mid-prompt has nothing to predict yet.
"""
from __future__ import annotations

import torch

from minivllm.attention import paged_attention_class
from minivllm.attention.paged import KVPool, PagedBatch
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.model import Decoder


class ModelRunner:
    def __init__(self, model: Decoder, num_blocks: int, block_size: int, attention: str = "torch"):
        self.model = model
        # Checked before the pool is allocated: an attention backend that cannot run here fails at once.
        self.attention_class = paged_attention_class(attention, model.device, model.dtype)
        self.pool = KVPool(model, num_blocks, block_size)

    @torch.inference_mode()
    def run(self, schedule: SchedulerOutput) -> tuple[list[int], torch.Tensor]:
        """Run the scheduled tokens. Returns the indices (into schedule.seqs) of the sequences
        that produce a token this step, and their logits [len(indices), vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        past_lens: list[int] = []
        last_rows: list[int] = []  # row of each sampling sequence's last token in the flat run
        sampling: list[int] = []
        for i, (seq, n) in enumerate(zip(schedule.seqs, schedule.num_new_tokens)):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            past_lens.append(start)
            if start + n == seq.num_tokens:  # caught up: the last position predicts a new token
                sampling.append(i)
                last_rows.append(len(input_ids) - 1)
        device = self.model.device
        batch = PagedBatch.build([seq.block_table for seq in schedule.seqs], past_lens, schedule.num_new_tokens,
                                 self.pool.block_size, device)
        attention = self.attention_class(self.pool, batch)
        hidden = self.model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), attention)
        if not sampling:
            return [], hidden.new_empty(0, self.model.config.vocab_size)
        return sampling, self.model.lm_head(hidden[last_rows])
