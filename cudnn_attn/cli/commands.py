"""The ``cudnn-attn`` command line: ``info``, ``bench``, ``cache {ls,clear,warm}``, ``--version``.

Exit status: 0 when done, 1 for an environment error (no GPU or cuDNN where one is needed, the
plan store off or refused, matplotlib missing), 2 for a usage error (argparse's own code).

Example::

    $ cudnn-attn info --json info.json
    $ cudnn-attn bench --grid --json grid.json --plot grid.png
    $ cudnn-attn bench --plot-from grid.json --plot grid.png
"""

from __future__ import annotations

import contextlib
import os
import sys

from ..bench.charts import NoChartError
from ..bench.reports import STDOUT
from ..errors import ValidationError
from . import bench_command, info, parser, store
from .failures import CommandError, usage, write_report


def main(argv: list[str] | None = None) -> int:
    args = parser.build().parse_args(argv)
    try:
        _check_targets(args)
        if args.command == "info":
            report = info.collect()
            if args.json:
                write_report("info", args.json, report)
            else:
                print(info.as_text(report))
            return 0
        if args.command == "bench":
            return _bench(args)
        return store.run(args)
    except CommandError as error:
        print(error, file=sys.stderr)
        return error.code
    except (ValidationError, NoChartError) as error:  # a shape, or a report, that cannot be used as given
        command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
        print(f"cudnn-attn {command}: {error}", file=sys.stderr)
        return 2


def _check_targets(args) -> None:  # type: ignore[no-untyped-def]
    """A ``--json`` or ``--plot`` file that cannot be written is a usage error before any work (a
    bench may run for minutes), not an ``OSError`` at the end."""
    command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
    for flag, target in (("--json", getattr(args, "json", None)), ("--plot", getattr(args, "plot", None))):
        if target and not (flag == "--json" and target == STDOUT):
            _check_writable(f"cudnn-attn {command}: {flag} {target}", target)


def _check_writable(where: str, target: str) -> None:
    """``target`` opened as the command will write it. ``os.access`` cannot tell: it says yes to
    root everywhere, /proc included. Opened to append, an existing file is left as it is, and a
    file the check made is removed again."""
    if os.path.isdir(target):
        raise usage(f"{where}: a directory; give a file to write")
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise usage(f"{where}: no directory {folder} to write it in")
    existed = os.path.lexists(target)
    if existed and not os.path.isfile(target):  # a device or a pipe: opening one may block or consume
        return
    try:
        with open(target, "a"):
            pass
    except OSError as error:
        raise usage(f"{where}: cannot be written ({error.strerror or error})") from error
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(target)


def _bench(args) -> int:  # type: ignore[no-untyped-def]
    return bench_command.run(args)


def _bench_parser():  # type: ignore[no-untyped-def]
    """The ``bench`` arguments alone (as ``main`` mounts them)."""
    return parser.bench()


__all__ = ["main"]


if __name__ == "__main__":
    sys.exit(main())
