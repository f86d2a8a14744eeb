"""Keep the guesses the target model agrees with, exactly in distribution (chapter 12).

The target scored a sequence's last token and its D guesses d_1..d_D in one forward pass, so it
has a distribution p_j over the next token at every position j = 0..D (p_0 follows the last
real token, p_j follows guess d_j). The draft proposed d_{j+1} from its own distribution q_j
(a lookup or a greedy draft is certain: q_j is 1 at d_{j+1}).

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023) walks the guesses in order:

    accept d_{j+1} with probability min(1, p_j(d_{j+1}) / q_j(d_{j+1}));
    at the first rejection, draw the token from norm(max(0, p_j - q_j)) and stop;
    if all D are accepted, draw one bonus token from p_D.

Every emitted token is then distributed exactly as if the target had sampled it alone: a guess
the target likes at least as much as the draft is always kept, one it likes less is kept in
proportion, and the residual puts back precisely the probability the draft took away. A step
emits between 1 and D + 1 tokens and never fewer than plain decoding would.

Greedy decoding is the special case where p_j is one-hot at the argmax: a guess is kept exactly
when it equals the target's argmax, and the first disagreement is replaced by that argmax.
"""
from __future__ import annotations

import torch

from minivllm.request.sampling_params import SamplingParams
from minivllm.worker.logit_bias import bias_logits
from minivllm.worker.sampler import apply_min_p, filter_logits


def rejection_sample(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor, noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify S sequences' guesses at once (see the module doc for the rule).

    target_probs: [S, K+1, V], row s, j: the target's distribution p_j after sequence s's guess
        j (j = 0: after its last real token); rows past num_drafts[s] are ignored.
    draft_tokens: [S, K] int64, the guesses d_1..d_K, padded with -1 past num_drafts[s].
    num_drafts: [S] int64, D_s in [1, K]: how many guesses sequence s has.
    draft_probs: [S, K, V], q_j, the draft distribution each guess was drawn from; None when
        every guess was certain (q_j is 1 at d_{j+1} and 0 elsewhere).
    uniforms: [S, K] in [0, 1): guess j+1 is accepted when uniforms[s, j] * q_j(d) < p_j(d)
        (that is, with probability min(1, p/q), without dividing by zero).
    noise: [S, V] Exp(1) draws: the token drawn from a distribution w (the residual, or p_D for
        the bonus) is argmax(w / noise[s]) (the exponential race: weights need no normalising).
    Returns (tokens [S, K+1] int64: the accepted guesses, then the drawn token, then -1 to the
    end; num_accepted [S] int64 in [0, D_s]). Sequence s emits num_accepted[s] + 1 tokens.
    Invariant: the accepted guesses are a prefix of the guesses (a rejection ends the run)."""
    # BEGIN SOLUTION
    S, K = draft_tokens.shape
    guesses = draft_tokens.clamp(min=0)  # the -1 padding reads token 0; those positions are masked below
    p_guess = target_probs[:, :K].gather(-1, guesses[..., None])[..., 0]  # [S, K]: p_j(d_{j+1})
    q_guess = torch.ones_like(p_guess) if draft_probs is None else draft_probs.gather(-1, guesses[..., None])[..., 0]
    real = torch.arange(K, device=guesses.device)[None, :] < num_drafts[:, None]
    accepted = (uniforms * q_guess < p_guess) & real
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # the leading run of acceptances
    rows = torch.arange(S, device=guesses.device)
    p_next = target_probs[rows, num_accepted]  # [S, V]: p after the last accepted guess
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=K - 1)  # where the rejection happened (when it did)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(1, guesses[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at]
    weights = torch.where(rejected[:, None], (p_next - q_next).clamp(min=0), p_next)
    drawn = (weights / noise).argmax(dim=-1)
    positions = torch.arange(K + 1, device=guesses.device)[None, :]
    padded = torch.cat([draft_tokens, torch.full((S, 1), -1, dtype=draft_tokens.dtype, device=guesses.device)], 1)
    tokens = torch.where(positions < num_accepted[:, None], padded, -1)
    tokens = torch.where(positions == num_accepted[:, None], drawn[:, None], tokens)
    return tokens, num_accepted
    # END SOLUTION


def target_probs(logits: torch.Tensor, params: SamplingParams, pasts: list[list[int]] | None = None) -> torch.Tensor:
    """The distribution the target would sample from at each row of `logits` [R, V] for a request
    with these params: the request's own edits first (logit_bias, allowed_token_ids, bad_words
    after pasts[r], row r's recent output: worker/logit_bias.py), then one-hot at the argmax when
    greedy; else softmax after temperature, min_p, top_k and top_p, the sampler's own functions
    in the sampler's order. [R, V] float32."""
    x = logits.float()
    if params.edits_logits:
        x = bias_logits(x, [params] * len(x), pasts if pasts is not None else [[]] * len(x))
    if params.greedy:
        return torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
    x = x / params.temperature
    rows = len(x)
    if params.min_p > 0:
        x = apply_min_p(x, torch.full((rows,), params.min_p, device=x.device))
    if params.top_k > 0 or params.top_p < 1:
        x = filter_logits(x, torch.full((rows,), params.top_k, device=x.device, dtype=torch.long),
                          torch.full((rows,), params.top_p, device=x.device))
    return x.softmax(dim=-1)
