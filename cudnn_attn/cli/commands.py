"""The ``cudnn-attn`` command line: ``info``, ``bench``, ``cache {ls,clear,warm}``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..bench.shapes import STANDARD_GRID, Shape, parse
from ..errors import ValidationError
from . import info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cudnn-attn", description="cuDNN fused attention, made easy.")
    commands = parser.add_subparsers(dest="command", required=True)

    show = commands.add_parser("info", help="GPU, cuDNN and frontend versions, and which features run here")
    show.add_argument("--json", action="store_true", help="print the report as JSON")

    commands.add_parser(
        "bench",
        parents=[_bench_parser()],
        add_help=False,
        help="time cudnn_attn against torch SDPA and the bare frontend",
        description="Time cudnn_attn against torch SDPA and the bare frontend (needs a CUDA GPU).",
    )

    cache = commands.add_parser("cache", help="the persistent plan store")
    actions = cache.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", help="list stored plans")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    actions.add_parser("clear", help="remove every stored plan")
    warm = actions.add_parser("warm", help="build (and tune) plans ahead of time, e.g. at a server's start")
    warm.add_argument(
        "shapes",
        nargs="*",
        help='shapes like "b=1,h=32,hkv=8,s=8192,d=128,causal,bwd", or a server\'s paged steps like '
        '"paged,h=32,hkv=8,d=128,page=64,batch=64,pages=512,cache=40000,sq=1/4,prefill=4096,graph"',
    )
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


class _HeadsOrHelp(argparse.Action):
    """FMHA_v2's convention: ``-h N`` sets the number of heads, a bare ``-h`` prints help."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:  # the const of nargs="?": -h given without a number
            parser.print_help()
            parser.exit()
        setattr(namespace, self.dest, values)


def _bench_parser() -> argparse.ArgumentParser:
    """The ``bench`` arguments, as a parser of their own; ``main`` mounts it as the subcommand."""
    bench = argparse.ArgumentParser(prog="cudnn-attn bench", add_help=False)
    bench.add_argument("--help", action="help", help="show this help and exit (so does a bare -h)")
    bench.add_argument(
        "shapes", nargs="*", help='shapes like "b=2,h=16,s=4096,d=128,causal" (default: the flags below)'
    )
    bench.add_argument("-b", "--batch", type=int, default=4, metavar="N", help="batch size (default: 4)")
    bench.add_argument(
        "-h",
        "--heads",
        type=int,
        nargs="?",
        const=None,
        default=16,
        action=_HeadsOrHelp,
        metavar="N",
        help="query heads (default: 16); a bare -h, without N, prints this help",
    )
    bench.add_argument("--kv-heads", type=int, default=0, metavar="N", help="K/V heads for GQA/MQA (default: --heads)")
    bench.add_argument("-s", "--seq", type=int, default=4096, metavar="N", help="sequence length (default: 4096)")
    bench.add_argument("-d", "--head-dim", type=int, default=128, metavar="N", help="head dimension (default: 128)")
    bench.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp8"), default="bf16",
        help="data type of Q, K, V (default: bf16); fp8: FP8 beside bf16 on d128 shapes, forward and backward",
    )  # fmt: skip
    bench.add_argument("--causal", action="store_true", help="causal (top-left) mask")
    bench.add_argument("--bwd", action="store_true", help="time the backward")
    bench.add_argument("--grid", action="store_true", help="run the standard grid of shapes")
    bench.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG bar chart to PATH (needs the plot extra)")
    bench.add_argument("--overhead", action="store_true", help="host time per call on a tiny shape")
    bench.add_argument("--cold-start", action="store_true", help="time to first result in fresh processes")
    sections = bench.add_argument_group(
        "fixed-shape sections",
        "Each runs its own shapes; given any of them, the attention table runs only for shapes given as "
        "arguments or --grid.",
    )
    sections.add_argument(
        "--frontend-rebuild",
        action="store_true",
        help="the frontend's notebook 50 graph rebuilt every call: through the frontend vs through cudnn_attn",
    )
    sections.add_argument(
        "--stack",
        action="store_true",
        help="4-layer decoder training step (hidden 2048, 16 heads, causal, bf16), torch SDPA vs cudnn_attn.sdpa",
    )
    sections.add_argument(
        "--paged-decode",
        action="store_true",
        help="paged K/V decode bandwidth (B64 Hq32/Hkv8 d128 S_kv 4096, page 64): graph vs frontend vs a copy",
    )
    sections.add_argument(
        "--naive",
        action="store_true",
        help="fused attention vs naive softmax(q k^T) v in torch (B4 H16 d64 fp16, S 512/2048/8192)",
    )
    sections.add_argument(
        "--varlen",
        action="store_true",
        help="mixed-length causal batch (128-8192 tokens, H16 d128 bf16) fwd+bwd: varlen_sdpa vs torch on the padded "
        "batch vs our graph on a fixed-length batch; plans built over 1,000 random packings",
    )
    sections.add_argument(
        "--serving",
        action="store_true",
        help="paged decode per layer inside a CUDA-graph replay (Hq32/Hkv8 d128, page 64; B 1-32, KV 2k-32k, "
        "S_q 1/4/8): PagedAttention vs one paged call vs torch on contiguous K/V, as a share of the memory's rate; "
        "chunked prefill (chunks 1-512 over caches up to 16k) in effective TFLOP/s",
    )
    sections.add_argument(
        "--models",
        action="store_true",
        help="training shapes of the frontend's own benchmark, fwd and bwd from 4k to 32k (DeepSeek-V3 B1 H128 "
        "d192/128; gpt-oss B2 H64/8 d64 with its 1024 window, with and without sinks): cudnn_attn.sdpa vs the bare "
        "frontend, with peak memory",
    )
    sections.add_argument(
        "--mla",
        action="store_true",
        help="MLA decode per layer in a CUDA-graph replay (DeepSeek-V3 latent d576/512, page 64; 16 and 128 heads, "
        "B 1-64, KV 4k-32k): PagedAttention's kernel vs cuDNN's paged decode, against the memory's peak",
    )
    sections.add_argument(
        "--context-parallel",
        type=int,
        metavar="GPUS",
        help="causal B1 training step (fwd+bwd) of one --seq sequence sharded over GPUS GPUs (p2p ring, zigzag; "
        "--heads, --head-dim) against one GPU, with the ring's compute and transfers timed alone",
    )
    return bench


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
    import importlib.util

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print('cudnn-attn bench: --plot needs matplotlib: pip install "cudnn-attn[plot]"', file=sys.stderr)
        return 2
    if not _needs_gpu("bench"):
        return 2
    from ..bench import attention

    if args.dtype == "fp8":
        from ..bench import fp8 as bench_fp8

        rows = bench_fp8.fp8_rows()
        print(bench_fp8.format_fp8(rows))
        crossover = bench_fp8.crossover()
        print(bench_fp8.format_crossover(crossover))
        accuracy = bench_fp8.accuracy()
        print(bench_fp8.format_accuracy(accuracy))
        _write_json(args.json, {"fp8": rows, "crossover": crossover, "accuracy": accuracy})
        return 0
    if args.context_parallel is not None:
        from ..bench import context_parallel as bench_context_parallel

        options = ["--gpus", str(args.context_parallel), "--seq", str(args.seq), "--heads", str(args.heads),
                   "--head-dim", str(args.head_dim)] + (["--json", args.json] if args.json else [])  # fmt: skip
        return bench_context_parallel.main(options)
    if args.serving:
        from ..bench import prefill as bench_prefill
        from ..bench import serving as bench_serving

        rows = bench_serving.serving_rows()
        print(bench_serving.format_serving(rows))
        prefill = bench_prefill.prefill_row()
        print(bench_prefill.format_prefill(prefill))
        _write_json(args.json, {"serving": rows, "prefill": prefill})
        return 0
    if args.mla:
        from ..bench import mla as bench_mla

        _write_json(args.json, bench_mla.mla_rows())
        return 0
    if args.models:
        from ..bench import model_shapes

        models = model_shapes.model_rows()
        print(model_shapes.format_models(models))
        _write_json(args.json, {"models": models})
        return 0
    if args.frontend_rebuild:
        from ..bench import frontend_rebuild

        rebuild = frontend_rebuild.rebuild_loop()
        print(frontend_rebuild.format_rebuild(rebuild))
        _write_json(args.json, rebuild)
        return 0
    if args.varlen:
        from ..bench import varlen as bench_varlen

        mixed, plans = bench_varlen.mixed_batch(), bench_varlen.plans_over_packings()
        llama = bench_varlen.llama_step() if importlib.util.find_spec("transformers") else None
        print(bench_varlen.format_varlen(mixed, plans, llama))
        _write_json(args.json, {"mixed": mixed, "plans": plans, "llama": llama})
        return 0
    sections = {"stack": args.stack, "paged_decode": args.paged_decode, "naive": args.naive}
    if args.grid:
        shapes = [parse(s) for s in STANDARD_GRID]
    elif args.shapes:
        shapes = [parse(s) for s in args.shapes]
    elif any(sections.values()):
        shapes = []  # the sections bring their own shapes
    else:
        shapes = [Shape(b=args.batch, h=args.heads, hkv=args.kv_heads, sq=args.seq, skv=args.seq, d=args.head_dim,
                        dtype=args.dtype, causal=args.causal, bwd=args.bwd)]  # fmt: skip
    attention.run(
        shapes, json_path=args.json, plot_path=args.plot, overhead=args.overhead, cold=args.cold_start, **sections
    )
    return 0


def _write_json(path: str | None, report: dict) -> None:
    """A section's figures to ``--json PATH`` (nothing without it), with the GPU they ran on."""
    if not path:
        return
    import torch

    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **report}, f, indent=2)


def _cache(args: argparse.Namespace) -> int:
    from ..cache import default_cache
    from ..plan_store import UnsafeStoreError

    store = default_cache().store
    if store is None:
        print("cudnn-attn cache: the persistent store is off (CUDNN_ATTN_CACHE_DIR is empty)", file=sys.stderr)
        return 2
    if args.action == "warm":
        return _warm(args)
    try:  # an unsafe or unreadable directory is refused with one line, never a traceback
        if args.action == "clear":
            print(f"removed {store.clear()} plan(s) from {store.path}")
            return 0
        rows = []
        for listed in store.entries():
            header = listed.entry.header if listed.entry else {}
            rows.append({
                "file": listed.path.name, "ok": listed.entry is not None, "bytes": listed.size, "problem": listed.problem,
                "plan": header.get("describe", "?"), "variant": header.get("variant", "?"),
                "engine": (header.get("choice") or {}).get("name", "?"),
                "gpu": (header.get("platform") or {}).get("gpu", "?"), "cudnn": (header.get("platform") or {}).get("cudnn", "?"),
            })  # fmt: skip
    except (UnsafeStoreError, OSError) as error:
        print(f"cudnn-attn cache {args.action}: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"path": str(store.path), "plans": rows}, indent=2))
    else:
        print(f"{store.path}: {len(rows)} plan(s)")
        for r in rows:
            status = "" if r["ok"] else f"  DAMAGED ({r['problem']}; ignored, rewritten on next build)"
            size = "?" if r["bytes"] is None else r["bytes"]
            print(
                f"  {r['file'][:12]}  {r['plan']:<52} {r['variant']:<9} {r['gpu']} cuDNN {r['cudnn']}  {size} B{status}"
            )
    return 0


def _warm(args: argparse.Namespace) -> int:
    texts = list(args.shapes)
    if args.file:
        try:
            with open(args.file) as f:
                texts += [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except (OSError, UnicodeDecodeError) as error:  # missing, unreadable or not text
            reason = getattr(error, "strerror", None) or error
            print(f"cudnn-attn cache warm: cannot read --file {args.file}: {reason}", file=sys.stderr)
            return 2
    if not texts:
        print("cudnn-attn cache warm: give shapes or --file", file=sys.stderr)
        return 2
    from ..bench import serving_shapes

    servers = [serving_shapes.parse(t) for t in texts if serving_shapes.is_serving(t)]
    shapes = [parse(t) for t in texts if not serving_shapes.is_serving(t)]
    if not _needs_gpu("cache warm"):
        return 2
    from .. import Graph

    for server in servers:  # tuned: a server's PagedAttention without autotune loads them as they are
        start = time.perf_counter()
        sources = server.warm(autotune=not args.no_autotune)
        counts = ", ".join(f"{sources.count(s)} {s}" for s in sorted(set(sources)))
        print(f"{server.label():<44} {time.perf_counter() - start:7.2f} s  ({counts})")
    for shape in shapes:
        start = time.perf_counter()
        t = shape.tensors("cuda")
        with Graph(autotune=not args.no_autotune) as g:
            g.sdpa(t["q"], t["k"], t["v"], use_causal_mask=shape.causal, generate_stats=shape.bwd)
        if shape.bwd:
            o, stats = g(t["q"], t["k"], t["v"])
            with Graph(autotune=not args.no_autotune) as gb:
                gb.sdpa_backward(t["q"], t["k"], t["v"], o, t["grad_o"], stats, use_causal_mask=shape.causal)
        sources = [getattr(n.plan, "source", "?") for n in g.nodes]
        print(f"{shape.label():<44} {time.perf_counter() - start:7.2f} s  ({', '.join(sources)})")
    return 0


__all__ = ["main"]


if __name__ == "__main__":
    sys.exit(main())
