"""Chapter 10: the streamed chunk made from a template (Chunks.plain_event) is byte for byte
the chunk made as a dict and serialised by json.dumps, for every kind of text and ending; chunks
that are not plain (logprobs, a pending echo) are left to the dict."""
from __future__ import annotations

import itertools
import json

import pytest

from minivllm.entrypoints.openai.responses import Echo
from minivllm.entrypoints.openai.sse import Chunks, Delta

pytestmark = pytest.mark.ch10
TEXTS = ["", "a", ' say "hi" \\ back/slash', "é世🙂", "\n\t\r\x00\x1f\x7f\u2028\u2029", "</script>"]
ENDINGS = [(None, None), ("length", None), ("stop", "\n\n"), ("stop", 7), ("stop", 'a"b')]


def reference(chunks: Chunks, delta: Delta, prompt: int) -> str:
    payload = chunks.delta(delta, None, prompt)  # no logprobs: the output is not read
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_the_template_gives_the_bytes_of_json_dumps(chat, n):
    chunks = Chunks('cmpl-"x"é', 1234567890, 'model "m" é', chat=chat, n=n)
    for text, (finish, stop), index, prompt in itertools.product(TEXTS, ENDINGS, range(n), (0, 2)):
        delta = Delta(index, text, [1, 2], 5, finish, stop)
        assert chunks.plain_event(delta, prompt) == reference(chunks, delta, prompt), (text, finish, stop)


def test_chunks_that_are_not_plain_are_left_to_the_dict():
    delta = Delta(0, "x", [1], 0)
    assert Chunks("c", 0, "m", chat=False, top_logprobs=2).plain_event(delta) is None
    echoing = Chunks("c", 0, "m", chat=False, echo=[Echo("P:", "P")])
    assert echoing.plain_event(delta) is None  # the prompt goes out first, with the dict
    echoing.delta(delta, None, 0)
    assert echoing.plain_event(delta) == reference(echoing, delta, 0)  # after it, plain chunks
