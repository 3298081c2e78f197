"""Speculative decoding: `proposers` (n-gram prompt lookup, options, building a drafter,
drafting after a step) and `draft_model` (a draft model over its own worker and runner).
Verification is the sampler's (`runner.sampler`). docs/speculative-decoding.md."""
