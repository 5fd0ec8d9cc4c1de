"""``cudnn-attn cache ls | clear | warm``: the persistent plan store, listed, emptied or filled."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from ..bench.progress import progress
from ..bench.reports import STDOUT
from ..bench.shapes import parse
from ..plan_store import choice_problems, json_type
from .failures import environment, needs_gpu, usage, write_report


def run(args: argparse.Namespace) -> int:
    from ..cache import default_cache
    from ..plan_store import UnsafeStoreError

    store = default_cache().store
    if store is None:
        raise environment("cudnn-attn cache: the persistent store is off (CUDNN_ATTN_CACHE_DIR is empty)")
    if args.action == "warm":
        return _warm(args)
    try:  # an unsafe or unreadable directory is refused with one line, never a traceback
        if args.action == "clear":
            print(f"removed {store.clear()} plan(s) from {store.path}")
            return 0
        rows = [_row(listed) for listed in store.entries()]
    except (UnsafeStoreError, OSError) as error:
        raise environment(f"cudnn-attn cache {args.action}: {error}") from error
    if args.json:
        write_report("cache ls", args.json, {"path": str(store.path), "plans": rows})
        if args.json == STDOUT:
            return 0
    print(f"{store.path}: {len(rows)} plan(s)")
    for r in rows:
        kind = "FOREIGN" if (r["problem"] or "").startswith(_FOREIGN) else "DAMAGED"
        status = "" if r["ok"] else f"  {kind} ({r['problem']}; ignored, rewritten on next build)"
        size = "?" if r["bytes"] is None else r["bytes"]
        print(f"  {r['file'][:12]}  {r['plan']:<52} {r['variant']:<9} {r['gpu']} cuDNN {r['cudnn']}  {size} B{status}")
    return 0


_FOREIGN = "header of another format"
_UNKNOWN = "?"


def _row(listed: Any) -> dict[str, Any]:
    """One plan file's line. A header another version of the library wrote may hold other types
    (a platform that is a string, a describe that is null) or lack the choice a load reads: those
    fields show as unknown, and the entry is flagged, since a load ignores it (its platform never
    matches; a choice it cannot read makes the build rebuild the plan)."""
    header = listed.entry.header if listed.entry else {}
    odd: list[str] = []
    platform = _record(header, "platform", odd, required=listed.entry is not None)
    fields = {
        "plan": _scalar(header, "describe", odd),
        "variant": _scalar(header, "variant", odd),
        "engine": _scalar(_record(header, "choice", []), "name", []),  # its problems: choice_problems's
        "gpu": _scalar(platform, "gpu", odd, "platform."),
        "cudnn": _scalar(platform, "cudnn", odd, "platform."),
    }
    if listed.entry is not None:
        odd += choice_problems(header)
    problem = listed.problem
    if listed.entry is not None and odd:
        problem = f"{_FOREIGN}: {', '.join(odd)}"
    return {
        "file": listed.path.name,
        "ok": listed.entry is not None and not odd,
        "bytes": listed.size,
        "problem": problem,
        **fields,
    }


def _record(header: dict[str, Any], name: str, odd: list[str], required: bool = False) -> dict[str, Any]:
    """``header[name]`` where it is a JSON object; empty (its fields unknown) where it is absent
    or of another type (noted in ``odd``; absent too where a load reads it: ``required``)."""
    if name not in header:
        if required:  # a load compares it with this platform's: never loaded without one
            odd.append(f"{name} is missing")
        return {}
    value = header[name]
    if isinstance(value, dict):
        return value
    odd.append(f"{name} is {json_type(value)}")
    return {}


def _scalar(record: dict[str, Any], name: str, odd: list[str], prefix: str = "") -> str | int | float:
    """``record[name]`` where it is a string or a number (a table cell); ``?`` where it is absent
    or of another type (noted in ``odd``)."""
    if name not in record:
        return _UNKNOWN
    value = record[name]
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return value
    odd.append(f"{prefix}{name} is {json_type(value)}")
    return _UNKNOWN


def _warm(args: argparse.Namespace) -> int:
    texts = list(args.shapes)
    if args.file:
        try:
            with open(args.file) as f:
                texts += [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except (OSError, UnicodeDecodeError) as error:  # missing, unreadable or not text
            reason = getattr(error, "strerror", None) or error
            raise usage(f"cudnn-attn cache warm: cannot read --file {args.file}: {reason}") from error
    if not texts:
        raise usage("cudnn-attn cache warm: give shapes or --file")
    from ..bench import serving_shapes

    servers = [serving_shapes.parse(t) for t in texts if serving_shapes.is_serving(t)]
    shapes = [parse(t) for t in texts if not serving_shapes.is_serving(t)]
    needs_gpu("cache warm")
    out = sys.stdout  # the JSON's stream: with --json -, the lines go to stderr instead
    with contextlib.redirect_stdout(sys.stderr) if args.json == STDOUT else contextlib.nullcontext():
        warmed = _build(servers, shapes, autotune=not args.no_autotune)
    if args.json:
        write_report("cache warm", args.json, {"warmed": warmed}, out)
    return 0


def _build(servers: list[Any], shapes: list[Any], autotune: bool) -> list[dict[str, Any]]:
    """Each server's steps and each shape's graphs built (and stored); a line each as it is done."""
    from .. import Graph

    warmed = []
    items = [(server, True) for server in servers] + [(shape, False) for shape in shapes]
    bar = progress(items, "cache warm", unit="item", leave=True)
    for item, is_server in bar:
        start = time.perf_counter()
        if is_server:  # tuned: a server's PagedAttention without autotune loads them as they are
            sources = item.warm(autotune=autotune)
        else:
            t = item.tensors("cuda")
            with Graph(autotune=autotune) as g:
                g.sdpa(t["q"], t["k"], t["v"], use_causal_mask=item.causal, generate_stats=item.bwd)
            if item.bwd:
                o, stats = g(t["q"], t["k"], t["v"])
                with Graph(autotune=autotune) as gb:
                    gb.sdpa_backward(t["q"], t["k"], t["v"], o, t["grad_o"], stats, use_causal_mask=item.causal)
            sources = [getattr(n.plan, "source", "?") for n in g.nodes]
        seconds = time.perf_counter() - start
        # A server's many plans as counts ("12 disk, 2 built"), a shape's few by name ("disk").
        shown = ", ".join(f"{sources.count(s)} {s}" for s in sorted(set(sources))) if is_server else ", ".join(sources)
        bar.write(f"{item.label():<44} {seconds:7.2f} s  ({shown})", file=sys.stdout)
        warmed.append({"shape": item.label(), "seconds": seconds, "sources": sources})
    return warmed
