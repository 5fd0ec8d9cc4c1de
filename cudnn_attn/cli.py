"""The ``cudnn-attn`` command line."""

from __future__ import annotations

import argparse
import sys

from . import info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cudnn-attn", description="cuDNN fused attention, made easy.")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("info", help="GPU, cuDNN and frontend versions, and which features run here")
    show.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.command == "info":
        report = info.collect()
        print(info.as_json(report) if args.json else info.as_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
