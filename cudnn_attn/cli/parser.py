"""The ``cudnn-attn`` arguments: one parser, a subcommand each for ``info``, ``bench`` and ``cache``.

``--json FILE`` means the same everywhere: write the report as JSON to FILE, ``-`` for stdout
(``info`` and ``cache ls`` also take a bare ``--json``, as before, for stdout).
"""

from __future__ import annotations

import argparse

from .failures import EPILOG

JSON_HELP = "write the report as JSON to FILE ('-': stdout)"


class _Version(argparse.Action):
    """``--version``: computed when asked (it imports torch and the frontend), then exit 0."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print versions and exit")

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        from .versions import version_text

        print(version_text())  # on stdout, as argparse's own version action prints
        parser.exit()


class _HeadsOrHelp(argparse.Action):
    """FMHA_v2's convention: ``-h N`` sets the number of heads, a bare ``-h`` prints help."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        if values is None:  # the const of nargs="?": -h given without a number
            parser.print_help()
            parser.exit()
        setattr(namespace, self.dest, values)


def build() -> argparse.ArgumentParser:
    """The whole command line."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="cudnn-attn", description="cuDNN fused attention, made easy.", epilog=EPILOG, formatter_class=formatter
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)

    show = commands.add_parser(
        "info",
        help="versions, the plan store, the features that run here and the environment variables",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    show.add_argument("--json", nargs="?", const="-", metavar="FILE", help=JSON_HELP + "; a bare --json: stdout")

    commands.add_parser(
        "bench",
        parents=[bench()],
        add_help=False,
        help="time cudnn_attn against torch SDPA and the bare frontend",
        description="Time cudnn_attn against torch SDPA and the bare frontend (needs a CUDA GPU; --plot-from "
        "does not).",
        epilog=EPILOG,
        formatter_class=formatter,
    )

    cache = commands.add_parser("cache", help="the persistent plan store", epilog=EPILOG, formatter_class=formatter)
    actions = cache.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", help="list stored plans", epilog=EPILOG, formatter_class=formatter)
    ls.add_argument("--json", nargs="?", const="-", metavar="FILE", help=JSON_HELP + "; a bare --json: stdout")
    actions.add_parser("clear", help="remove every stored plan", epilog=EPILOG, formatter_class=formatter)
    warm = actions.add_parser(
        "warm",
        help="build (and tune) plans ahead of time, e.g. at a server's start",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    warm.add_argument(
        "shapes",
        nargs="*",
        help='shapes like "b=1,h=32,hkv=8,s=8192,d=128,causal,bwd", or a server\'s paged steps like '
        '"paged,h=32,hkv=8,d=128,page=64,batch=64,pages=512,cache=40000,sq=1/4,prefill=4096,graph"',
    )
    warm.add_argument("--file", help="a file with one shape per line")
    warm.add_argument("--no-autotune", action="store_true", help="store heuristic plans without tuning")
    warm.add_argument(
        "--json",
        metavar="FILE",
        help="write what was warmed, with seconds and plan sources, as JSON to FILE ('-': stdout)",
    )
    return parser


def bench() -> argparse.ArgumentParser:
    """The ``bench`` arguments, as a parser of their own; ``build`` mounts it as the subcommand."""
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
        "--dtype",
        choices=("bf16", "fp16", "fp8"),
        default="bf16",
        help="data type of Q, K, V (default: bf16); fp8: FP8 beside bf16 on d128 shapes, forward and backward",
    )
    bench.add_argument("--causal", action="store_true", help="causal (top-left) mask")
    bench.add_argument("--bwd", action="store_true", help="time the backward")
    bench.add_argument(
        "--grid", action="store_true", help="run the standard grid of shapes (shapes given beside it are refused)"
    )
    bench.add_argument(
        "--json", metavar="FILE", help="write every figure as JSON to FILE ('-': stdout; the tables then go to stderr)"
    )
    bench.add_argument(
        "--plot",
        metavar="PNG",
        help="draw every section run as a PNG chart, spreads as error bars (needs the plot "
        "extra; the extension names the format: .png, or .svg, .pdf, ...); a section without a chart is a usage "
        "error",
    )
    bench.add_argument(
        "--plot-from",
        metavar="JSON",
        help="redraw --plot from a report saved with --json, measuring nothing (no GPU needed)",
    )
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
        "batch vs our graph on a fixed-length batch; plans built over 1,000 random packings; memory of a packed step "
        "(GQA 32/8) at 32k and 128k tokens: peak bytes beyond its tensors, bytes held after",
    )
    sections.add_argument(
        "--serving",
        action="store_true",
        help="paged decode per layer inside a CUDA-graph replay (Hq32/Hkv8 d128, page 64 or --page; B 1-64, KV 2k-32k, "
        "S_q 1/4/8): PagedAttention vs one paged call vs torch on contiguous K/V, as a share of the memory's rate; "
        "chunked prefill (chunks 1-512 over caches up to 16k) in effective TFLOP/s",
    )
    sections.add_argument(
        "--page",
        type=int,
        choices=(16, 32, 64, 128, 256),
        help="--serving's decode table over pages of N tokens (default 64; vLLM's default block is 16; "
        "the chunked-prefill row keeps pages of 64)",
    )
    sections.add_argument(
        "--models",
        action="store_true",
        help="training shapes of the frontend's own benchmark, fwd and bwd from 4k to 32k (DeepSeek-V3 B1 H128 "
        "d192/128; gpt-oss B2 H64/8 d64 with its 1024 window, with and without sinks): cudnn_attn.sdpa vs the bare "
        "frontend, with peak memory",
    )
    sections.add_argument(
        "--batching",
        action="store_true",
        help="transformers' continuous batching (generate_batch, 64 requests of 32-1024 prompt tokens, 64 new each, a "
        "Llama-shaped model with random weights, CUDA graphs on) on cudnn_attn against its own sdpa: tokens per second "
        "and how many greedy tokens agree",
    )
    sections.add_argument(
        "--score-terms",
        action="store_true",
        help="soft-capping (causal, cap 50: B2 H16/8 S4k d128, B1 H32/16 S8k d256, Gemma-2 9B through the transformers "
        "registration) and gpt-oss's sinks (B2 H64/8 S8k d64, windows 128 / 1024 / none), fwd and fwd+bwd, each against "
        "the same call without its term",
    )
    sections.add_argument(
        "--mla",
        action="store_true",
        help="MLA decode per layer in a CUDA-graph replay (DeepSeek-V3 latent d576/512, page 64; 16 and 128 heads, "
        "B 1-64, KV 4k-32k): PagedAttention's kernel vs cuDNN's paged decode, against the memory's peak; on Hopper also "
        "the split-KV bound (the same reads, partial writes and merge with no math)",
    )
    sections.add_argument(
        "--context-parallel",
        type=int,
        metavar="GPUS",
        help="causal B1 training step (fwd+bwd) of one --seq sequence sharded over GPUS GPUs (p2p ring, zigzag; "
        "--heads, --head-dim) against one GPU, with the ring's compute and transfers timed alone",
    )
    sections.add_argument(
        "--cp-mode", choices=("p2p", "all_gather"), default=None, help="--context-parallel's mode (default p2p)"
    )
    sections.add_argument(
        "--packed",
        action="store_true",
        help="--context-parallel over packed documents of long-tailed lengths (--seq tokens in all), against the "
        "same packing on one GPU and against padding",
    )
    return bench
