"""The latencies a user feels, said once for every timed request: the online simulation's
(chapter 7) and the load generator's over HTTP (chapter 10).

A request starts (arrives, or is sent) at `start`; its tokens arrive at `token_times`, one
entry per token or per chunk of tokens. From those:

    TTFT  time to first token       token_times[0] - start
    E2E   end-to-end latency        token_times[-1] - start
    TPOT  time per output token     (token_times[-1] - token_times[0]) / (tokens - 1)
    ITL   inter-token latencies     the gaps between consecutive arrivals
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


class Latencies:
    """Mixed into a dataclass with `start: float` and `token_times: list[float]`."""

    start: float
    token_times: list[float]

    @property
    def num_tokens_received(self) -> int:
        """Tokens that arrived: one per entry of token_times, unless a subclass counts them
        otherwise (a streamed chunk may hold several)."""
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        n = self.num_tokens_received
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times))


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """p50, p90, p99 and the mean of some latencies (seconds)."""
    values = list(values)
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES} | {"mean": float(np.mean(values))}


def latency_percentiles(requests: Sequence[Latencies]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT, ITL and E2E of these requests at p50/p90/p99 and their mean (seconds); a
    measure that no request has (TPOT of one-token answers) is left out."""
    values = {"ttft": [r.ttft for r in requests], "tpot": [r.tpot for r in requests if r.tpot is not None],
              "itl": [gap for r in requests for gap in r.itls], "e2e": [r.e2e for r in requests]}
    return {name: percentiles(v) for name, v in values.items() if v}
