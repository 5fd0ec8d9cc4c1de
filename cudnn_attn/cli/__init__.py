"""``cudnn_attn.cli``: the ``cudnn-attn`` command. ``commands`` (``main``: dispatch, exit codes),
``parser`` (every argument; ``--json FILE``, ``-`` for stdout), ``failures`` (exit 1 for environment
errors, 2 for usage errors), ``versions`` (``--version``), ``info`` with ``features`` (this machine's
GPU, versions, plan store, features and environment variables), ``bench_command`` (sections,
``--plot``, ``--plot-from``) and ``store`` (``cache ls/clear/warm``). ``python -m cudnn_attn`` and
``python -m cudnn_attn.cli`` run it too. A tool: nothing in the library imports it.
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
