"""Mask comparisons whose failure message shows the masks: small matrices of 1 (may attend)
and . (hidden), expected next to got, so a student sees at once which cells are wrong."""
from __future__ import annotations

import torch


def show(mask: torch.Tensor) -> str:
    """A bool mask as text; a [B, L, L] stack is shown one row of the batch after another."""
    if mask.dim() == 3:
        return "\n".join(f"[{b}]\n{show(m)}" for b, m in enumerate(mask))
    return "\n".join(" ".join("1" if x else "." for x in row) for row in mask.tolist())


def assert_mask_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    expected = expected.bool()
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
        raise AssertionError(f"{what}: a mask is a torch.bool tensor, got {type(got).__name__} "
                             f"{getattr(got, 'dtype', '')}")
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}\n"
                             f"expected (1 = may attend, . = hidden):\n{show(expected)}")
    if not torch.equal(got.cpu(), expected):
        raise AssertionError(f"{what}: wrong cells (1 = may attend, . = hidden)\n"
                             f"expected:\n{show(expected)}\ngot:\n{show(got.cpu())}")


def mask(rows: list[str]) -> torch.Tensor:
    """A hand-written mask: mask(["1 .", "1 1"]) -> [[True, False], [True, True]]."""
    return torch.tensor([[c == "1" for c in row.split()] for row in rows])
