"""Chapter 12: speculative decoding. Guess several tokens cheaply, verify them in one forward pass.

    (config/speculative.py: speculative_config, checked: {"method": "ngram" | "draft_model", ...})
    ngram.py        prompt lookup: guesses from the sequence's own earlier tokens
    draft_model.py  a small model with the same vocabulary guesses, from a paged cache of its own
    rejection.py    keep the guesses the target agrees with, exactly in distribution
    rollback.py     take back what the verify step computed for rejected guesses
    speculator.py   the steps LLMEngine.step adds: propose, fit, verify, roll back; the counters

Verification is chapter 5's chunked prefill (a sequence's last token and its guesses form one
chunk in the ragged batch) and the rollback is chapter 6's block manager giving blocks back.
"""
