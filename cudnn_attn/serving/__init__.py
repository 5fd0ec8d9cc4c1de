"""``cudnn_attn.serving``: ``PagedAttention``, attention over paged KV caches for inference servers:
plan once per step, run per layer. ``paged_attention`` (the public class), ``step`` (one step's
derived tables and working buffers), ``schedule`` (split-KV, query packing and the decode
kernel's choice). The package root re-exports ``PagedAttention``.
"""
