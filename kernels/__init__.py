"""Triton kernels of the engine's GPU path, each beside a plain PyTorch reference of the same function.

None yet: the engine runs on its PyTorch model code (engine/). The GPU-path issue adds tree-verify attention,
KV-cache compaction, the tree builder and the tree walk here.
"""
