"""Structured outputs: what a request's text must match (`spec`), its compiled grammar
(`grammar`, cached and compiled off the engine thread) and the per-sequence matcher that masks
each step's logits (`matcher`). `spec` and `grammar` are torch-free so the gateway can validate
a request before anything is scheduled."""
