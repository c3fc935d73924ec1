"""The embedded inference engine: continuous batching on torch + transformers (CPU or one GPU).

The package itself imports nothing: loading a run config reads ``config`` here, and must not pay
for torch (``engine``).
"""
