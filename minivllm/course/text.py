"""Small helpers for showing text: encode a prompt (or make random ids when the checkpoint
has no tokenizer, e.g. a config-only shape) and print a prompt with its continuation."""
from __future__ import annotations

import random
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

console = Console()

# Prompts the embedded model continues well. They end mid-line: a prompt that ends in a newline
# or in indentation leaves the byte-level BPE a token boundary it rarely saw in training.
DEMO_PROMPT = "import os\n\ndef list_files(path):\n    return"
DEMO_PROMPTS = [
    DEMO_PROMPT,
    "def read_lines(path):\n    with open(path) as f:\n        return",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.",
]


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token ids, one prompt per length."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def encode_or_random(tokenizer: Any | None, text: str, vocab_size: int, seed: int = 0) -> list[int]:
    """The text's token ids, or 8 random ids when there is no tokenizer."""
    if tokenizer is not None:
        return tokenizer.encode(text)
    return random_prompts([8], vocab_size, seed)[0]


def demo_prompts(tokenizer: Any | None, vocab_size: int) -> list[list[int]]:
    """Prompts of different lengths: DEMO_PROMPTS if there is a tokenizer, random ids if not."""
    if tokenizer is not None:
        return [tokenizer.encode(t) for t in DEMO_PROMPTS]
    return random_prompts([5, 2, 11], vocab_size)


def decode(tokenizer: Any | None, ids: list[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))


def show_sample(tokenizer: Any | None, prompt: list[int], output: list[int], title: str = "sample") -> None:
    """Print the prompt (dim) followed by the generated continuation (bold)."""
    text = Text(decode(tokenizer, prompt), style="dim")
    text.append("" if tokenizer is not None else " ")  # token ids need a separator; text does not
    text.append(decode(tokenizer, output), style="bold green")
    console.print(Panel(text, title=f"{title} (greedy, {len(output)} new tokens)"))
