"""Train the tiny default model that ships inside minivllm.

The course needs a real, trained model that loads in a second on any laptop,
so every chapter can show sensible text without downloading anything. This
script makes one from data every Python install already has: the source code
of the standard library.

    python tools/train_default_model.py --out minivllm/default_model --minutes 50

It also makes the draft model for speculative decoding (chapter 12): a much
smaller model that must share the default model's vocabulary, so it reuses
that tokenizer (copied byte for byte) instead of training its own:

    python tools/train_default_model.py --out minivllm/draft_model --tokenizer minivllm/default_model \
        --hidden 128 --layers 2 --heads 2 --kv-heads 1 --intermediate 352 --minutes 30 --threads 1 \
        --figure figures/draft_model_loss.png

Steps: collect the corpus, train a byte-level BPE tokenizer (or load one), build a small
Qwen3-architecture model, train it with a plain PyTorch loop, save a Hugging
Face folder (so `transformers.AutoModelForCausalLM` loads it) plus a loss plot
and a `training_log.json`. Everything random is seeded. A `--minutes` run
follows the clock (CPUs are often shared, so the step count varies a little
from run to run); `--steps N` follows the step count and replays exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS = "<|endoftext|>"
# What save_pretrained writes for a fast tokenizer; --tokenizer copies whichever of these exist.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test"}
MAX_FILE_BYTES = 16 * 2**20


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted, without test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append(path)
    # Sort by relative path so the order (and thus the split) is the same everywhere.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path], held_out: float, seed: int) -> tuple[list[Path], list[Path]]:
    """Split by file, not by token, so held-out code is code the model never saw."""
    rng = random.Random(seed)
    n_held = max(1, round(held_out * len(files)))
    held = set(rng.sample(range(len(files)), n_held))
    train = [f for i, f in enumerate(files) if i not in held]
    return train, [f for i, f in enumerate(files) if i in held]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte is a token, so any text encodes and decodes losslessly."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],  # id 0; a real special token, never split or merged
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # No cleanup of spaces on decode: code must come back byte for byte.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, clean_up_tokenization_spaces=False
    )


def load_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """An existing model's tokenizer: a draft model must propose tokens from the target's vocabulary."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    if tokenizer.eos_token != EOS:  # the corpus stream separates files with this exact token
        raise SystemExit(f"{folder}: EOS is {tokenizer.eos_token!r}, expected {EOS!r}")
    return tokenizer


def encode_files(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One long token stream: file, EOS, file, EOS, ... (the EOS marks document ends)."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """A Qwen3 decoder shrunk to a few million parameters (GQA, q/k-norm, tied head)."""
    eos = tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        max_position_embeddings=args.context,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return Qwen3ForCausalLM(config)


def lr_at(step: int, progress: float, warmup: int, peak: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to a tenth of the peak as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def random_batch(stream: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of context+1 tokens (inputs and shifted targets)."""
    starts = torch.randint(0, len(stream) - context - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + context + 1] for s in starts])


def step_loss(model: Qwen3ForCausalLM, window: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Cross-entropy of predicting window[:, 1:] from window[:, :-1].

    With bf16, matmuls run in bfloat16 (about twice as fast on CPUs with
    AVX512-BF16 or AMX) while weights, gradients and AdamW state stay float32.
    """
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=window[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def held_out_loss(model: Qwen3ForCausalLM, windows: torch.Tensor, batch: int, bf16: bool = False) -> float:
    """Mean next-token loss over fixed, non-overlapping held-out windows."""
    model.eval()
    losses = [step_loss(model, w, bf16).item() for w in windows.split(batch)]
    model.train()
    return sum(losses) / len(losses)


def make_optimizer(model: Qwen3ForCausalLM, lr: float) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (decaying norm gains just hurts)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def train(model: Qwen3ForCausalLM, stream: torch.Tensor, held_windows: torch.Tensor,
          args: argparse.Namespace, seconds: float) -> list[dict]:
    """The training loop. Returns the loss history (one row per evaluation).

    With --steps the schedule runs on the step count and the run is exactly
    reproducible. Otherwise it runs on the clock: the cosine reaches its end
    after `seconds`, however fast the (possibly shared) CPU turns out to be.
    """
    gen = torch.Generator().manual_seed(args.seed)
    opt = make_optimizer(model, args.lr)
    history = [{"step": 0, "train_loss": None, "held_out_loss": held_out_loss(model, held_windows, args.batch, args.bf16)}]
    start, step, progress, recent = time.perf_counter(), 0, 0.0, []
    columns = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn()]
    with Progress(*columns) as bar:
        task = bar.add_task("training", total=1.0)
        while progress < 1.0:
            lr = lr_at(step, progress, args.warmup, args.lr)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = step_loss(model, random_batch(stream, args.batch, args.context, gen), args.bf16)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # tames early loss spikes
            opt.step()
            recent.append(loss.item())
            step += 1
            progress = step / args.steps if args.steps else (time.perf_counter() - start) / seconds
            if step % args.eval_every == 0 or progress >= 1.0:
                row = {"step": step, "train_loss": sum(recent) / len(recent),
                       "held_out_loss": held_out_loss(model, held_windows, args.batch, args.bf16)}
                history.append(row)
                recent = []
                bar.console.print(f"step {step:5d}  lr {lr:.2e}  train {row['train_loss']:.3f}  "
                                  f"held-out {row['held_out_loss']:.3f}")
            bar.update(task, completed=progress, description=f"step {step}  loss {loss.item():.3f}")
    return history


def plot_history(history: list[dict], path: Path, title: str) -> None:
    """Train and held-out loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in history if r["train_loss"] is not None]
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train (mean since last eval)")
    ax.plot([r["step"] for r in history], [r["held_out_loss"] for r in history], "o-", ms=3,
            label="held-out stdlib files")
    ax.set(xlabel="step", ylabel="cross-entropy (nats / token)", title=title,
           ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def hardware() -> str:
    """A one-line description of where training ran."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [l.split(":", 1)[1].strip() for l in cpuinfo.read_text().splitlines() if l.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def save(out: Path, model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, log: dict,
         tokenizer_from: Path | None = None) -> None:
    """A standard Hugging Face folder plus training_log.json.

    A reused tokenizer is copied file by file rather than re-saved: save_pretrained
    may rewrite the JSON (another transformers version, another key order), and the
    draft's tokenizer files should be byte-identical to the target's.
    """
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer_from is None:
        tokenizer.save_pretrained(out)
    else:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists():
                shutil.copyfile(tokenizer_from / name, out / name)
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False).save_pretrained(out)
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=50.0, help="time budget (ignored with --steps)")
    p.add_argument("--steps", type=int, default=None, help="exact number of steps (reproducible)")
    p.add_argument("--vocab", type=int, default=4096, help="size of the tokenizer to train (not with --tokenizer)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="FOLDER",
                   help="reuse this model folder's tokenizer (copied as-is) instead of training one")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704, help="704, not 768: fp32 weights stay under 16 MiB")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in plain float32")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--held-out", type=float, default=0.02, help="fraction of files held out")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--figure", type=Path, default=Path("figures/default_model_loss.png"))
    return p.parse_args(argv)


def load_corpus(args: argparse.Namespace) -> tuple[PreTrainedTokenizerFast, torch.Tensor, torch.Tensor, dict]:
    """The tokenizer, the training token stream, the held-out windows and corpus facts for the log."""
    train_files, held_files = split_files(stdlib_files(), args.held_out, args.seed)
    train_texts = [f.read_text(encoding="utf-8") for f in train_files]
    held_texts = [f.read_text(encoding="utf-8") for f in held_files]
    # Same files, same split either way: only where the vocabulary comes from changes.
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else train_tokenizer(train_texts, args.vocab)
    stream, held = encode_files(tokenizer, train_texts), encode_files(tokenizer, held_texts)
    # Non-overlapping held-out windows, fixed for the whole run so evaluations are comparable.
    n_windows = len(held) // (args.context + 1)
    held_windows = held[: n_windows * (args.context + 1)].view(n_windows, args.context + 1)
    facts = {"python": platform.python_version(), "train_files": len(train_files),
             "held_out_files": len(held_files), "train_bytes": sum(len(t.encode()) for t in train_texts),
             "train_tokens": len(stream), "held_out_tokens": len(held)}
    return tokenizer, stream, held_windows, facts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # 2 by default: a small laptop, and comparable runs
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    tokenizer, stream, held_windows, corpus = load_corpus(args)
    print(f"corpus: {corpus}")
    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")
    if 4 * n_params > MAX_FILE_BYTES:  # the checkpoint lives in git: check before an hour of training
        raise SystemExit(f"{n_params:,} float32 parameters do not fit one {MAX_FILE_BYTES:,}-byte file")
    # The budget counts from the start of the script; keep a minute for the final evaluation and saving.
    seconds = 60 * (args.minutes - 1) - (time.perf_counter() - start)
    history = train(model, stream, held_windows, args, seconds)
    steps = history[-1]["step"]
    final_held = held_out_loss(model, held_windows, args.batch)  # in float32, as the model is shipped

    log = {
        "command": " ".join(["python tools/train_default_model.py", *(argv if argv is not None else sys.argv[1:])]),
        "seed": args.seed,
        "steps": steps,
        "tokens_seen": steps * args.batch * args.context,
        "minutes": round((time.perf_counter() - start) / 60, 1),
        "parameters": n_params,
        "corpus": corpus,
        "final_train_loss": history[-1]["train_loss"],
        "final_held_out_loss": final_held,
        "hardware": hardware(),
        "precision": "bf16 autocast, fp32 weights" if args.bf16 else "fp32",
        "history": history,
    }
    save(args.out, model, tokenizer, log, args.tokenizer)
    plot_history(history, args.figure, f"minivllm {args.out.name.replace('_', ' ')}")
    print(f"saved {args.out} ({steps} steps, held-out loss {final_held:.3f}) and {args.figure}")


if __name__ == "__main__":
    main()
