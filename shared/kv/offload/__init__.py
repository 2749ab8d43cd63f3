"""KV offload tiers: blocks evicted from the engine's pool are kept in host memory (tier 2) and
on local disk (tier 3), and loaded back when a prompt's prefix hits them (`shared/kv/tiers.py`).
"""
