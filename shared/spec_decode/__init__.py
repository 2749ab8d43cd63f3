"""Speculative decoding: proposers (n-gram, draft model, self-speculative), lossless
verification (greedy and rejection sampling), and the per-request adaptive k with its batch
switch. `speculator.build_speculator` assembles them for the engine."""
