"""Bridges to other libraries. Each submodule imports its library when it is imported, never before:
``import cudnn_attn`` does not import them.

- ``cudnn_attn.integrations.transformers``: ``register()`` adds ``attn_implementation="cudnn_attn"``
  to Hugging Face transformers.
"""
