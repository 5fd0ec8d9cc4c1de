"""The ``cudnn-attn`` command line: ``info``, ``bench``, ``cache {ls,clear,warm}``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import info
from .errors import ValidationError
from .shapes import STANDARD_GRID, Shape, parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cudnn-attn", description="cuDNN fused attention, made easy.")
    commands = parser.add_subparsers(dest="command", required=True)

    show = commands.add_parser("info", help="GPU, cuDNN and frontend versions, and which features run here")
    show.add_argument("--json", action="store_true", help="print the report as JSON")

    bench = commands.add_parser(
        "bench", help="time cudnn_attn against torch SDPA and the bare frontend", add_help=False
    )
    bench.add_argument("--help", action="help", help="show this help and exit")
    bench.add_argument(
        "shapes", nargs="*", help='shapes like "b=2,h=16,s=4096,d=128,causal" (default: the flags below)'
    )
    bench.add_argument("-b", "--batch", type=int, default=4)
    bench.add_argument("-h", "--heads", type=int, default=16)
    bench.add_argument("--kv-heads", type=int, default=0, help="K/V heads for GQA/MQA (default: --heads)")
    bench.add_argument("-s", "--seq", type=int, default=4096)
    bench.add_argument("-d", "--head-dim", type=int, default=128)
    bench.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    bench.add_argument("--causal", action="store_true")
    bench.add_argument("--bwd", action="store_true", help="time the backward")
    bench.add_argument("--grid", action="store_true", help="run the standard grid of shapes")
    bench.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG bar chart to PATH")
    bench.add_argument("--overhead", action="store_true", help="host time per call on a tiny shape")
    bench.add_argument("--cold-start", action="store_true", help="time to first result in fresh processes")

    cache = commands.add_parser("cache", help="the persistent plan store")
    actions = cache.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", help="list stored plans")
    ls.add_argument("--json", action="store_true")
    actions.add_parser("clear", help="remove every stored plan")
    warm = actions.add_parser("warm", help="build (and tune) plans ahead of time, e.g. at a server's start")
    warm.add_argument("shapes", nargs="*", help='shapes like "b=1,h=32,hkv=8,s=8192,d=128,causal,bwd"')
    warm.add_argument("--file", help="a file with one shape per line")
    warm.add_argument("--no-autotune", action="store_true", help="store heuristic plans without tuning")

    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            report = info.collect()
            print(info.as_json(report) if args.json else info.as_text(report))
            return 0
        if args.command == "bench":
            return _bench(args)
        return _cache(args)
    except ValidationError as error:
        print(f"cudnn-attn: {error}", file=sys.stderr)
        return 2


def _needs_gpu(what: str) -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    print(
        f"cudnn-attn {what}: needs a CUDA GPU (none is visible); plans are built and stored for cuDNN only",
        file=sys.stderr,
    )
    return False


def _bench(args: argparse.Namespace) -> int:
    if not _needs_gpu("bench"):
        return 2
    from . import bench

    if args.grid:
        shapes = [parse(s) for s in STANDARD_GRID]
    elif args.shapes:
        shapes = [parse(s) for s in args.shapes]
    else:
        shapes = [Shape(b=args.batch, h=args.heads, hkv=args.kv_heads, sq=args.seq, skv=args.seq, d=args.head_dim,
                        dtype=args.dtype, causal=args.causal, bwd=args.bwd)]  # fmt: skip
    bench.run(shapes, json_path=args.json, plot_path=args.plot, overhead=args.overhead, cold=args.cold_start)
    return 0


def _cache(args: argparse.Namespace) -> int:
    from .cache import default_cache

    store = default_cache().store
    if store is None:
        print("cudnn-attn cache: the persistent store is off (CUDNN_ATTN_CACHE_DIR is empty)", file=sys.stderr)
        return 2
    if args.action == "ls":
        rows = []
        for file, entry in store.entries():
            header = entry.header if entry else {}
            rows.append({
                "file": file.name, "ok": entry is not None, "bytes": file.stat().st_size,
                "plan": header.get("describe", "?"), "variant": header.get("variant", "?"),
                "engine": (header.get("choice") or {}).get("name", "?"),
                "gpu": (header.get("platform") or {}).get("gpu", "?"), "cudnn": (header.get("platform") or {}).get("cudnn", "?"),
            })  # fmt: skip
        if args.json:
            print(json.dumps({"path": str(store.path), "plans": rows}, indent=2))
        else:
            print(f"{store.path}: {len(rows)} plan(s)")
            for r in rows:
                status = "" if r["ok"] else "  DAMAGED (ignored; rewritten on next build)"
                print(
                    f"  {r['file'][:12]}  {r['plan']:<52} {r['variant']:<9} {r['gpu']} cuDNN {r['cudnn']}  {r['bytes']} B{status}"
                )
        return 0
    if args.action == "clear":
        print(f"removed {store.clear()} plan(s) from {store.path}")
        return 0
    return _warm(args)


def _warm(args: argparse.Namespace) -> int:
    texts = list(args.shapes)
    if args.file:
        with open(args.file) as f:
            texts += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if not texts:
        print("cudnn-attn cache warm: give shapes or --file", file=sys.stderr)
        return 2
    shapes = [parse(t) for t in texts]
    if not _needs_gpu("cache warm"):
        return 2
    from . import Graph

    for shape in shapes:
        start = time.perf_counter()
        t = shape.tensors("cuda")
        with Graph(autotune=not args.no_autotune) as g:
            g.sdpa(t["q"], t["k"], t["v"], use_causal_mask=shape.causal, generate_stats=shape.bwd)
        if shape.bwd:
            o, stats = g(t["q"], t["k"], t["v"])
            with Graph(autotune=not args.no_autotune) as gb:
                gb.sdpa_backward(t["q"], t["k"], t["v"], o, t["d_o"], stats, use_causal_mask=shape.causal)
        sources = [getattr(n.plan, "source", "?") for n in g.nodes]
        print(f"{shape.label():<44} {time.perf_counter() - start:7.2f} s  ({', '.join(sources)})")
    return 0


__all__ = ["main"]


if __name__ == "__main__":
    sys.exit(main())
