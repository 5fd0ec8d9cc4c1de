"""MkDocs hook: tables generated from the package itself, so the docs cannot drift from it.

A page holds a marker line, ``<!-- generated: NAME -->``, which this hook replaces with the
table ``NAME`` when the site is built:

- ``support-matrix``: each feature of ``cudnn-attn info`` against GPU architectures and cuDNN
  versions, from the capability rules cuDNN requests are checked with before they are built.
- ``environment``: every environment variable the package reads (``core/environment.py``).
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)
HAVE = re.compile(r" \(have [^)]*\)")

# (column title, compute capability, cuDNN version as cudnnGetVersion() gives it)
PLATFORMS = [
    ("A100, cuDNN 9.0", (8, 0), 90000),
    ("A100, cuDNN 9.19", (8, 0), 91900),
    ("L40S, cuDNN 9.19", (8, 9), 91900),
    ("H100, cuDNN 9.2", (9, 0), 90200),
    ("H100, cuDNN 9.6", (9, 0), 90600),
    ("H100, cuDNN 9.19", (9, 0), 91900),
    ("B200, cuDNN 9.19", (10, 0), 91900),
]


def support_matrix() -> str:
    from cudnn_attn.cli.features import sample_problems
    from cudnn_attn.ops.cudnn.capabilities import Platform, unsupported_reasons

    problems = sample_problems("cuda:0")
    header = "| feature | " + " | ".join(title for title, _, _ in PLATFORMS) + " |"
    lines = [header, "| --- |" + " :---: |" * len(PLATFORMS)]
    notes: dict[str, int] = {}
    for feature, problem in problems.items():
        cells = []
        for title, arch, version in PLATFORMS:
            reasons = unsupported_reasons(problem, Platform(title.split(",")[0], arch, version, "1.32.0"))
            if not reasons:
                cells.append("yes")
                continue
            # "(have 9.0)" differs per column; the rule does not: one note per rule
            marks = [notes.setdefault(HAVE.sub("", reason), len(notes) + 1) for reason in reasons]
            cells.append("no (" + ", ".join(map(str, marks)) + ")")
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{number}. {reason}" for reason, number in notes.items()]
    return "\n".join(lines)


def environment() -> str:
    from cudnn_attn.core.environment import VARIABLES

    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(lines)


TABLES = {"support-matrix": support_matrix, "environment": environment}


def on_page_markdown(markdown: str, **_: Any) -> str:
    def table(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise ValueError(f"unknown generated table {name!r}; known: {', '.join(TABLES)}")
        return TABLES[name]()

    return MARKER.sub(table, markdown)
