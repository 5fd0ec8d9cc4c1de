"""A report to JSON and back: ``--json FILE`` writes FILE, ``--json -`` writes stdout.

Example::

    write_json("-", {"device": "NVIDIA H100", "rows": []})  # to stdout
    report = read_json("docs/bench/grid_h100.json")
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

STDOUT = "-"


def write_json(dest: str, report: Any, stdout: TextIO | None = None) -> None:
    """``report`` as indented JSON to the file ``dest``, or to ``stdout`` (default: ``sys.stdout``)
    when ``dest`` is ``-``."""
    text = json.dumps(report, indent=2) + "\n"
    if dest == STDOUT:
        (stdout or sys.stdout).write(text)
        return
    with open(dest, "w") as f:
        f.write(text)


def read_json(path: str) -> Any:
    """A report saved by ``--json`` (``OSError`` or ``ValueError`` when it cannot be read as JSON)."""
    with open(path) as f:
        return json.load(f)
