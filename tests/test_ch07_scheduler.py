"""Chapter 7: the rules of Scheduler.schedule, one check each, on hand-made states: a block
manager of a few blocks, requests with chosen token counts and block tables, and the exact plan
each rule implies (who computes how many tokens, who is preempted, who waits). A check's
message names its rule and prints the state, the expected plan and the plan it got.

The end-to-end checks (test_ch07_engine.py) prove that the engine's tokens stay right under
preemption; these prove that the plans are the ones the docstring promises, which tokens alone
cannot: a scheduler that admits too eagerly, or at the wrong time, still produces the right
tokens, only with more recomputation."""
from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.core.block_manager import BlockManager
from minivllm.core.scheduler import Scheduler
from minivllm.request.sequence import SchedulerOutput
from minivllm.request.sequence import Sequence, Status

pytestmark = [pytest.mark.ch07]

BLOCK = 4  # tokens per block in every state here


class State:
    """A scheduler over a pool of `num_blocks` blocks of BLOCK tokens, filled by hand."""

    def __init__(self, num_blocks: int, budget: int = 64, max_num_seqs: int = 8,
                 manager: BlockManager | None = None):
        self.manager = manager or BlockManager(num_blocks, BLOCK)
        self.scheduler = Scheduler(self.manager, budget, max_num_seqs)
        self.seqs: dict[str, Sequence] = {}

    def running(self, name: str, num_tokens: int, computed: int, blocks: list[int]) -> Sequence:
        """A running request (admitted in that order) holding `blocks`, with `computed` of its
        `num_tokens` tokens in the cache."""
        seq = self._seq(name, num_tokens)
        for block in blocks:
            self.manager.free.remove(block)
        seq.block_table, seq.num_computed_tokens, seq.status = list(blocks), computed, Status.RUNNING
        self.scheduler.running.append(seq)
        return seq

    def waiting(self, name: str, num_tokens: int) -> Sequence:
        seq = self._seq(name, num_tokens)
        self.scheduler.add(seq)
        return seq

    def _seq(self, name: str, num_tokens: int) -> Sequence:
        seq = Sequence(name, [1 + i % 50 for i in range(num_tokens)], SamplingParams(max_tokens=64), max_model_len=1000)
        self.seqs[name] = seq
        return seq

    def describe(self) -> str:
        running = ", ".join(f"{s.request_id} ({s.num_computed_tokens}/{s.num_tokens} tokens computed, blocks "
                            f"{s.block_table})" for s in self.scheduler.running)
        waiting = ", ".join(f"{s.request_id} ({s.num_tokens} tokens)" for s in self.scheduler.waiting)
        return (f"blocks of {BLOCK} tokens, {self.manager.num_free} of {self.manager.num_blocks} free; budget "
                f"{self.scheduler.max_num_batched_tokens} tokens, max_num_seqs {self.scheduler.max_num_seqs}\n"
                f"  running, oldest first: {running or 'none'}\n  waiting, in arrival order: {waiting or 'none'}")

    def check(self, rule: str, grants: dict[str, int], preempted: list[str] = ()) -> SchedulerOutput:
        """Run one schedule() and compare its plan with the expected one."""
        before = self.describe()
        out = self.scheduler.schedule()
        assert isinstance(out, SchedulerOutput), f"schedule() returned {out!r}, not its SchedulerOutput"
        got = (dict(zip((s.request_id for s in out.seqs), out.num_new_tokens)), [s.request_id for s in out.preempted])
        expected = (grants, list(preempted))
        assert got == expected and len(out.seqs) == len(got[0]), (
            f"rule: {rule}\nstate before the step:\n{before}\n"
            f"expected: grants {expected[0]}, preempted {expected[1]}\n"
            f"got:      grants {dict(zip((s.request_id for s in out.seqs), out.num_new_tokens))}, preempted {got[1]}")
        return out

    def blocks_after(self, rule: str, **tables: int) -> None:
        """How many blocks each named request holds after the step (0 for a waiting one)."""
        got = {name: len(self.seqs[name].block_table) for name in tables}
        assert got == tables, f"rule: {rule}\nblocks held after the step: expected {tables}, got {got}"


def test_running_requests_go_first_oldest_first_under_the_budget():
    state = State(num_blocks=8, budget=6)
    state.running("old", num_tokens=12, computed=4, blocks=[0])  # in its prompt: 8 tokens to go
    state.running("new", num_tokens=5, computed=4, blocks=[1])  # decoding
    state.waiting("queued", num_tokens=3)
    state.check("running requests first, oldest first, each granted min(tokens left, budget left): the budget of 6 "
                "goes to 'old''s prompt; nothing is left for 'new' or for the queue", {"old": 6})
    state.blocks_after("a grant of n tokens grows the table to num_computed_tokens + n tokens", old=3, new=1, queued=0)


def test_a_newcomer_gets_what_the_budget_leaves_and_blocks_for_those_tokens_only():
    state = State(num_blocks=8, budget=7)
    state.running("decoding", num_tokens=3, computed=2, blocks=[0])
    state.waiting("long", num_tokens=20)
    out = state.check("waiting requests get the budget the running ones left (6 of 'long''s 20 prompt tokens)",
                      {"decoding": 1, "long": 6})
    state.blocks_after("a newcomer gets blocks for the tokens it was granted, not for its whole prompt", long=2)
    long = state.seqs["long"]
    assert long.status is Status.RUNNING and state.scheduler.running[-1] is long and not state.scheduler.waiting, \
        "rule: an admitted request is RUNNING, popped from waiting and appended to the end of running"
    assert out.seqs[-1] is long


def test_a_newcomer_must_leave_one_free_block_per_running_request():
    state = State(num_blocks=4)
    state.running("decoding", num_tokens=4, computed=3, blocks=[0])  # fills its block: next step it needs another
    state.waiting("prompt", num_tokens=12)  # 3 blocks: exactly the 3 free ones
    state.check("a newcomer comes in only if the free blocks cover its whole num_tokens plus one block per running "
                "request: 'prompt' needs 3 blocks and 'decoding' one spare, 4 > 3 free, so it waits", {"decoding": 1})
    state.blocks_after("a request that does not come in holds no blocks", prompt=0)
    assert state.seqs["prompt"].num_computed_tokens == 0 and list(state.scheduler.waiting) == [state.seqs["prompt"]]


def test_requests_admitted_earlier_in_the_step_count_as_running():
    state = State(num_blocks=4)
    state.waiting("first", num_tokens=4)  # 1 block
    state.waiting("second", num_tokens=12)  # 3 blocks
    state.check("one free block per running request counts those admitted earlier in the same step: after 'first' "
                "(1 block), 'second' needs its 3 blocks + 1 for 'first' = 4 > 3 free", {"first": 4})


def test_nobody_overtakes_a_head_that_does_not_fit():
    state = State(num_blocks=6)
    state.running("decoding", num_tokens=6, computed=5, blocks=[0, 1])
    state.waiting("big", num_tokens=20)  # 5 blocks > 4 free
    state.waiting("small", num_tokens=2)  # would fit
    state.check("the head of the queue that does not fit blocks everyone behind it (first come, first served): "
                "'small' must not overtake 'big'", {"decoding": 1})


def test_no_more_than_max_num_seqs_run():
    state = State(num_blocks=16, max_num_seqs=2)
    state.running("a", num_tokens=3, computed=2, blocks=[0])
    state.waiting("b", num_tokens=3)
    state.waiting("c", num_tokens=3)
    state.check("admission stops when max_num_seqs requests run", {"a": 1, "b": 3})


def test_when_blocks_run_out_the_newest_running_request_is_preempted():
    state = State(num_blocks=4)
    state.waiting("queued", num_tokens=2)
    state.running("oldest", num_tokens=5, computed=4, blocks=[0])  # needs a second block, none is free
    state.running("middle", num_tokens=5, computed=4, blocks=[1, 2])
    state.running("newest", num_tokens=3, computed=2, blocks=[3])
    state.check("while a running request's blocks do not fit, the newest running request is preempted "
                "(not the one in the middle); no one is admitted in a step that preempted",
                {"oldest": 1, "middle": 1}, preempted=["newest"])
    newest = state.seqs["newest"]
    assert list(state.scheduler.waiting) == [newest, state.seqs["queued"]], \
        "rule: the preempted request goes back to the front of the queue (self.preempt does it)"
    assert (newest.status, newest.block_table, newest.num_computed_tokens) == (Status.WAITING, [], 0)


def test_preemption_goes_on_until_the_blocks_fit():
    state = State(num_blocks=4)
    state.running("grower", num_tokens=12, computed=4, blocks=[0])  # a chunk of 8 needs 2 more blocks
    state.running("second", num_tokens=3, computed=2, blocks=[1])
    state.running("third", num_tokens=3, computed=2, blocks=[2])
    state.running("fourth", num_tokens=3, computed=2, blocks=[3])
    state.check("preempt the newest, again and again, until the request's blocks fit: 'fourth', then 'third'",
                {"grower": 8, "second": 1}, preempted=["fourth", "third"])


def test_a_request_that_preempts_itself_ends_the_walk():
    state = State(num_blocks=3)
    state.running("older", num_tokens=6, computed=5, blocks=[0, 1])
    state.running("newest", num_tokens=5, computed=4, blocks=[2])  # needs a block; only its own to give
    state.waiting("queued", num_tokens=2)
    state.check("the newest request that cannot grow preempts itself, and the walk stops there; no one is "
                "admitted in a step that preempted", {"older": 1}, preempted=["newest"])
    assert list(state.scheduler.waiting) == [state.seqs["newest"], state.seqs["queued"]]


class SharedPrefix(BlockManager):
    """Chapter 6's manager, sharing one cached prefix the way chapter 11's prefix cache does:
    blocks 0 and 1 hold PREFIX's K/V for a request that keeps them; any request that begins with
    PREFIX gets them back from reuse_prefix (they are shared, so release never frees them)."""

    PREFIX, SHARED = [1 + i % 50 for i in range(2 * BLOCK)], [0, 1]

    def reuse_prefix(self, seq: Sequence) -> int:
        if seq.token_ids[:len(self.PREFIX)] != self.PREFIX:
            return 0
        seq.block_table.extend(self.SHARED)
        return len(self.PREFIX)

    def release(self, table: list[int]) -> None:
        self.free.extend(b for b in table if b not in self.SHARED)
        table.clear()


def test_no_request_is_admitted_in_a_step_that_preempted():
    """With shared blocks, a request preempted for its own blocks could find its prefix shared
    and fit again at once: it must not come back in the step that preempted it."""
    state = State(num_blocks=6, manager=SharedPrefix(6, BLOCK))
    state.running("owner", num_tokens=13, computed=12, blocks=[0, 1, 2])  # holds the shared prefix; needs a 4th block
    state.running("copy", num_tokens=10, computed=9, blocks=[3, 4, 5])  # computed the same prefix itself, earlier
    state.check("admit only if nothing was preempted this step: 'copy' was preempted and must not be admitted "
                "again in the same plan", {"owner": 1}, preempted=["copy"])
    assert state.seqs["copy"].block_table == [] and state.seqs["copy"].num_computed_tokens == 0, \
        "rule: a waiting request holds no blocks and has nothing computed"
