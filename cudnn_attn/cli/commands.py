"""The ``cudnn-attn`` command line: ``info``, ``bench``, ``cache {ls,clear,warm}``, ``--version``.

Exit status: 0 when done, 1 for an environment error (no GPU or cuDNN where one is needed, the
plan store off or refused, matplotlib missing), 2 for a usage error (argparse's own code).

Example::

    $ cudnn-attn info --json info.json
    $ cudnn-attn bench --grid --json grid.json --plot grid.png
    $ cudnn-attn bench --plot-from grid.json --plot grid.png
"""

from __future__ import annotations

import os
import sys

from ..bench.charts import NoChartError
from ..bench.reports import STDOUT, write_json
from ..errors import ValidationError
from . import bench_command, info, parser, store
from .failures import CommandError, usage


def main(argv: list[str] | None = None) -> int:
    args = parser.build().parse_args(argv)
    try:
        _check_json_target(args)
        if args.command == "info":
            report = info.collect()
            if args.json:
                write_json(args.json, report)
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


def _check_json_target(args) -> None:  # type: ignore[no-untyped-def]
    """A ``--json`` file that cannot be written is a usage error before any work (a bench may run
    for minutes), not an ``OSError`` at the end."""
    target = getattr(args, "json", None)
    if not target or target == STDOUT:
        return
    command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(target):
        raise usage(f"cudnn-attn {command}: --json {target}: a directory; give a file to write")
    if not os.path.isdir(folder):
        raise usage(f"cudnn-attn {command}: --json {target}: no directory {folder} to write it in")
    if not os.access(folder, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise usage(f"cudnn-attn {command}: --json {target}: not writable")


def _bench(args) -> int:  # type: ignore[no-untyped-def]
    return bench_command.run(args)


def _bench_parser():  # type: ignore[no-untyped-def]
    """The ``bench`` arguments alone (as ``main`` mounts them)."""
    return parser.bench()


__all__ = ["main"]


if __name__ == "__main__":
    sys.exit(main())
