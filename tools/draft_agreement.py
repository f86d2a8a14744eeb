"""How often does the draft model guess the target's next token? Greedy agreement on unseen code.

In greedy speculative decoding (chapter 12) the draft proposes tokens and the
target keeps a proposal exactly when it equals its own greedy token. So the
number that matters is the *agreement rate*: along the target's own greedy
continuation of a prompt, how often the draft's argmax equals the target's.
Both models see the same prefix at every position (teacher forcing), which is
what happens while proposals are being accepted.

    python tools/draft_agreement.py                     # shipped draft vs shipped default model
    python tools/draft_agreement.py --draft /tmp/other_draft --json agreement.json

Two kinds of prompt: ordinary code (seeded slices of files from an installed
third-party package; both models were trained only on the standard library)
and repetitive code (a small pattern repeated, which the target continues).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm.loader import DEFAULT_MODEL, DRAFT_MODEL

# A small pattern, written out once per name, then the start of one more item (not ending in
# whitespace, see code_prompts): the target continues from inside the pattern. (The 4M-parameter target copies it only loosely and
# soon settles into loops of its own, which are repetitive code too.)
PATTERNS = {
    "getters": ('    def get_{0}(self):\n        """Return the {0}."""\n        return self._{0}\n\n',
                ["width", "height", "color", "style", "title", "border"], "    def get_size(self):"),
    "tests": ("def test_{0}_is_positive():\n    assert compute_{0}(1) > 0\n\n\n",
              ["area", "volume", "length", "weight", "speed", "price"], "def test_height"),
    "dict": ('    "{0}": {{"name": "{0}", "enabled": True}},\n',
             ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"], '    "eta":'),
    "init": ("        self.{0} = {0}\n", ["name", "value", "parent", "children", "style"], "        self."),
}


def package_files(name: str) -> list[Path]:
    """An installed package's .py files, sorted so a seed picks the same ones everywhere."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{name!r} is not an installed package")
    return sorted(Path(list(spec.submodule_search_locations)[0]).rglob("*.py"))


def code_prompts(tokenizer, package: str, n: int, n_tokens: int, seed: int = 0) -> list[str]:
    """n prompts of at most n_tokens tokens, each from a different file, from a line's start to a line's end.

    A prompt stops before its last newline: byte-level BPE merges a newline with the
    next line's indentation, so a prompt ending in a bare newline would tell the model
    that the next line starts at column 0.
    """
    rng = random.Random(seed)
    files = package_files(package)
    rng.shuffle(files)
    prompts = []
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        if len(tokenizer.encode("".join(lines), add_special_tokens=False)) < 2 * n_tokens:
            continue  # too short to cut a prompt from anywhere but its start
        start = rng.randrange(len(lines) // 2)
        ids = tokenizer.encode("".join(lines[start:]), add_special_tokens=False)[:n_tokens]
        text = tokenizer.decode(ids)
        prompts.append(text[: text.rfind("\n")])
        if len(prompts) == n:
            break
    return prompts


def repetitive_prompts() -> list[str]:
    return ["".join(pattern.format(name) for name in names) + start for pattern, names, start in PATTERNS.values()]


def accepted_per_pass(matches: list[bool], k: int) -> float:
    """Tokens per target forward pass of greedy speculative decoding with k proposals.

    Each pass keeps the proposals up to the first mismatch (at most k) plus one
    token of the target's own, so the agreement sequence alone decides it.
    """
    i = passes = 0
    while i < len(matches):
        run = 0
        while run < k and i + run < len(matches) and matches[i + run]:
            run += 1
        i += run + 1
        passes += 1
    return len(matches) / passes


@torch.no_grad()
def agreement(draft, target, tokenizer, prompt: str, new_tokens: int) -> list[bool]:
    """For each token of the target's greedy continuation: did the draft's argmax match the target's?"""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    full = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    # One forward pass each over prompt + continuation; the logits at position p predict token p + 1.
    span = slice(ids.shape[1] - 1, full.shape[1] - 1)
    target_next = target(input_ids=full).logits[0, span].argmax(-1)
    draft_next = draft(input_ids=full).logits[0, span].argmax(-1)
    return (draft_next == target_next).tolist()


def measure(draft_dir: str | Path = DRAFT_MODEL, target_dir: str | Path = DEFAULT_MODEL, package: str = "rich",
            n_prompts: int = 8, prompt_tokens: int = 200, new_tokens: int = 64, k: int = 4, seed: int = 0) -> dict:
    """Agreement rates (and tokens per target pass) on ordinary and on repetitive code."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if AutoTokenizer.from_pretrained(draft_dir).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{draft_dir} and {target_dir} have different vocabularies")
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    groups = {"ordinary": code_prompts(tokenizer, package, n_prompts, prompt_tokens, seed),
              "repetitive": repetitive_prompts()}
    result = {"draft": str(draft_dir), "target": str(target_dir), "package": package, "new_tokens": new_tokens,
              "k": k, "groups": {}}
    for name, prompts in groups.items():
        per_prompt = [agreement(draft, target, tokenizer, p, new_tokens) for p in prompts]
        matches = [m for ms in per_prompt for m in ms]
        result["groups"][name] = {
            "prompts": len(prompts),
            "prompt_tokens": [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts],
            "positions": len(matches),
            "agreement": sum(matches) / len(matches),
            "per_prompt": [sum(ms) / len(ms) for ms in per_prompt],
            "tokens_per_target_pass": sum(accepted_per_pass(ms, k) * len(ms) for ms in per_prompt) / len(matches),
        }
    return result


def print_table(result: dict) -> None:
    table = Table(title=f"greedy agreement: {result['draft']} proposing for {result['target']}")
    for column in ("code", "prompts", "positions", "agreement", f"tokens / target pass (k={result['k']})"):
        table.add_column(column, justify="left" if column == "code" else "right")
    for name, g in result["groups"].items():
        table.add_row(name, str(g["prompts"]), str(g["positions"]), f"{g['agreement']:.1%}",
                      f"{g['tokens_per_target_pass']:.2f}")
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=str(DRAFT_MODEL), help="draft model folder")
    p.add_argument("--target", default=str(DEFAULT_MODEL), help="target model folder")
    p.add_argument("--package", default="rich", help="installed package whose code makes the ordinary prompts")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=64, help="length of the target's greedy continuation")
    p.add_argument("-k", type=int, default=4, help="proposals per target pass, for the tokens-per-pass column")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small models: more threads barely help, and CPUs are often shared
    result = measure(args.draft, args.target, args.package, args.prompts, args.prompt_tokens, args.new_tokens,
                     args.k, args.seed)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
