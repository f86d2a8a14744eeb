"""How good is the default model? Bits per byte on Python code it never saw.

A language model is a compressor: with arithmetic coding, a text costs
-log2 p(text) bits under the model. Dividing by the text's UTF-8 bytes gives
*bits per byte*, a number that does not depend on the tokenizer and can be set
beside general-purpose compressors run on the very same bytes.

    python tools/bits_per_byte.py                       # the shipped model
    python tools/bits_per_byte.py --max-bytes 20000 --json bpb.json

The text is a seeded sample of .py files from third-party packages that are
installed with minivllm (the default model saw only the standard library).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import lzma
import math
import random
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm.loader import DEFAULT_MODEL

DEFAULT_PACKAGES = ("rich", "transformers", "matplotlib")
SKIP_DIRS = {"test", "tests"}
PER_FILE = 8192  # bytes taken from the start of each file: more files, more variety per KB


def package_files(name: str) -> list[Path]:
    """A package's .py files (tests left out), sorted so a seed picks the same ones everywhere."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{name!r} is not an installed package")
    root = Path(list(spec.submodule_search_locations)[0])
    files = [p for p in root.rglob("*.py")
             if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")]
    return sorted(files)


def sample_code(packages: list[str], max_bytes: int, seed: int = 0) -> tuple[str, int]:
    """The first PER_FILE bytes of files taken in turn from each package, in a seeded order.

    Taking turns keeps one big package (transformers has thousands of files)
    from crowding out the others. Returns the text (at most max_bytes) and the
    number of files used.
    """
    rng = random.Random(seed)
    queues = []
    for name in packages:
        files = package_files(name)
        rng.shuffle(files)
        queues.append(files)
    parts, size = [], 0
    while size < max_bytes and any(queues):
        for queue in queues:
            if queue and size < max_bytes:
                data = queue.pop().read_bytes()[: min(PER_FILE, max_bytes - size)]
                parts.append(data.decode("utf-8", errors="ignore"))  # a cut may split a character
                size += len(parts[-1].encode())
    return "".join(parts), len(parts)


def window_nats(model, windows: torch.Tensor) -> float:
    """Summed cross-entropy of predicting windows[:, 1:] from windows[:, :-1]."""
    logits = model(input_ids=windows[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum").item()


@torch.no_grad()
def model_nats(model, tokenizer, text: str, context: int, batch: int = 8) -> tuple[float, int]:
    """Total cross-entropy (nats) of the text's tokens, in non-overlapping windows.

    The stream starts with EOS, the document separator the model was trained
    with, so even the first real token is predicted (and paid for). Each token
    is predicted exactly once, from at most `context` tokens before it.
    """
    ids = [tokenizer.eos_token_id] + tokenizer.encode(text, add_special_tokens=False)
    seq = torch.tensor(ids)
    n_full = (len(seq) - 1) // context
    # Windows of context+1 tokens that overlap by one: the last target of one is the first input of the next.
    full = seq[: n_full * context + 1].unfold(0, context + 1, context)
    total = sum(window_nats(model, w) for w in full.split(batch))
    tail = seq[n_full * context :]
    if len(tail) > 1:
        total += window_nats(model, tail[None])
    return total, len(ids) - 1


def compressed_bits(data: bytes) -> dict[str, float]:
    """Bits per byte of two classic compressors at their strongest settings."""
    return {
        "gzip -9": 8 * len(gzip.compress(data, compresslevel=9)) / len(data),
        "xz -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data),
    }


def measure(model_dir: str | Path = DEFAULT_MODEL, packages: list[str] | tuple[str, ...] = DEFAULT_PACKAGES,
            max_bytes: int = 200_000, seed: int = 0) -> dict:
    """Bits per byte of the model and of gzip/xz on the same sample of unseen code."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text, n_files = sample_code(list(packages), max_bytes, seed)
    data = text.encode("utf-8")
    nats, n_tokens = model_nats(model, tokenizer, text, model.config.max_position_embeddings)
    bits = {"model": nats / math.log(2) / len(data), **compressed_bits(data)}
    return {"model_dir": str(model_dir), "packages": list(packages), "seed": seed, "files": n_files,
            "bytes": len(data), "tokens": n_tokens, "bits_per_byte": bits}


def print_table(result: dict) -> None:
    """The result as a rich table; the model's "compressed size" is what arithmetic coding would reach."""
    table = Table(title=f"bits per byte on {result['bytes']:,} bytes of unseen Python "
                        f"({result['files']} files from {', '.join(result['packages'])})")
    table.add_column("method")
    table.add_column("bits / byte", justify="right")
    table.add_column("compressed size", justify="right")
    for name, bpb in result["bits_per_byte"].items():
        table.add_row(name, f"{bpb:.3f}", f"{bpb * result['bytes'] / 8 / 1024:,.1f} KiB")
    Console().print(table)
    Console().print(f"{result['tokens']:,} tokens, {result['bytes'] / result['tokens']:.2f} bytes per token")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face model folder")
    p.add_argument("--max-bytes", type=int, default=200_000)
    p.add_argument("--packages", default=",".join(DEFAULT_PACKAGES), help="comma-separated package names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))  # a small laptop; more threads barely help here
    result = measure(args.model, args.packages.split(","), args.max_bytes, args.seed)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
