"""``cudnn_attn.cli``: the ``cudnn-attn`` command. ``commands`` (``main``: argument parsing, ``info``,
``bench`` dispatch, ``cache ls/clear/warm``) and ``info`` (the report of this machine's GPU, versions
and features). ``python -m cudnn_attn.cli`` runs it too. A tool: nothing in the library imports it.
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
