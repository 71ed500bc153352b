"""The policy: the model, its tokenizer, batched sampling, the policy server that batches
turns, parameter files.
"""
