"""How a command ends: 0 when done, 1 for what this machine lacks, 2 for what was asked wrongly.

A command raises ``CommandError`` (made by ``usage`` or ``environment``); ``main`` prints its one
line to stderr and returns its code. 2 is argparse's own code for bad arguments, so every usage
error reads the same to a script.

Example::

    raise usage("cudnn-attn bench: --plot-from needs --plot OUT.png")
"""

from __future__ import annotations

from typing import Any, TextIO

from ..bench.reports import write_json
from . import versions

OK, ENVIRONMENT, USAGE = 0, 1, 2

EPILOG = """\
exit status:
  0  done
  1  environment error: no CUDA GPU or no loadable cuDNN library where one is needed, the plan
     store off or refused, matplotlib missing for --plot
  2  usage error: bad arguments, a shape or a file that cannot be read, a --json or --plot
     file that cannot be written, a bench section that --plot has no chart for"""


class CommandError(Exception):
    """A command's failure: one line for stderr, and the exit code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def usage(message: str) -> CommandError:
    return CommandError(USAGE, message)


def environment(message: str) -> CommandError:
    return CommandError(ENVIRONMENT, message)


def needs_gpu(what: str) -> None:
    """Raise an environment error unless a CUDA GPU is visible and cuDNN loads."""
    import torch

    if not torch.cuda.is_available():
        raise environment(f"cudnn-attn {what}: needs a CUDA GPU (none is visible); plans are built for cuDNN only")
    reason = versions.cudnn_missing()
    if reason:
        raise environment(f"cudnn-attn {what}: needs cuDNN: {reason}")


def write_report(command: str, dest: str, report: Any, stdout: TextIO | None = None) -> None:
    """``write_json``; a ``--json`` file that fails as it is written (a full disk, /dev/full, which
    the check before any work cannot foresee) is a usage error naming it, not a traceback."""
    try:
        write_json(dest, report, stdout)
    except OSError as error:
        raise usage(f"cudnn-attn {command}: --json {dest}: cannot be written ({error.strerror or error})") from error
