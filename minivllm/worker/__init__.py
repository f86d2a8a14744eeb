"""The model runner (chapters 7-9, 16): one step's plan -> flat tensors -> one forward pass -> tokens.

    prepare.py        a step's inputs as flat arrays, in one copy to the device (chapter 9)
    input_batch.py    chapter 16: block tables in rows kept across steps, written by difference
    model_runner.py   a plan -> one forward pass -> logits; cuda_graphs.py replays decode steps
    sampler.py        logits -> tokens (penalties.py: what requests may ask for; chapter 13's mask first)
    logit_bias.py     a request's own edits: allowed_token_ids, bad_words, logit_bias (sampler and verifier)
    sampled_tokens.py a step's tokens on the device, read by the next step (chapter 16)

It knows the model and a step's sequences; it never schedules.
"""
