"""splitserve's engine core (`splitserve.engine`), shared by the prefill and decode pods.

The public API is the package root's: `from splitserve import LLM, SamplingParams`.
"""
