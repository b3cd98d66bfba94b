"""Sampling: the sampler, penalties, bad words, the random draws, prompt logprobs and speculative decoding's proposals and checks."""
