"""``cudnn-attn bench``: run the sections asked for, then write ``--json`` and draw ``--plot``.

Every section's figures form one report (what ``--json`` writes and ``--plot-from`` reads back),
so a chart drawn now and one redrawn later from the JSON are the same chart. Usage errors are
found before anything is measured, environment errors before anything is built.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
from typing import Any

from ..bench import charts
from ..bench.reports import STDOUT, read_json
from ..bench.shapes import STANDARD_GRID, Shape, parse, range_problems
from ..errors import ValidationError
from . import parser
from .failures import environment, needs_gpu, usage, write_report

ALONE = (
    "serving",
    "mla",
    "models",
    "score_terms",
    "batching",
    "frontend_rebuild",
    "varlen",
)  # each runs by itself when given
TARGETS = ("stack", "paged_decode", "naive")


def run(args: argparse.Namespace) -> int:
    if args.plot_from:
        return _redraw(args)
    if (args.cp_mode is not None or args.packed) and args.context_parallel is None:
        raise usage("cudnn-attn bench: --cp-mode and --packed go with --context-parallel GPUS")
    if args.page is not None and not args.serving:
        raise usage("cudnn-attn bench: --page goes with --serving")
    _check_numbers(args)
    sections = requested(args)
    if args.plot:
        missing = [name for name in sections if name not in charts.CHARTED]
        if missing:
            raise usage(
                f"cudnn-attn bench: --plot has no chart for the {', '.join(missing)} section; drop --plot "
                "(--json keeps every figure)"
            )
        _needs_matplotlib()
        _check_plot_format(args.plot)
    if "batching" in sections:
        _needs_continuous_batching()
    needs_gpu("bench")
    out = sys.stdout  # the JSON's stream: with --json -, every table goes to stderr instead
    with contextlib.redirect_stdout(sys.stderr) if args.json == STDOUT else contextlib.nullcontext():
        report = _measure(args)
    if args.json:
        write_report("bench", args.json, report, out)
    if args.plot:
        _draw(report, args.plot)
    return 0


# The flag each number of the flags' shape comes from, as its errors name it.
FLAGS = {
    "b": "-b/--batch",
    "h": "-h/--heads",
    "hkv": "--kv-heads",
    "sq": "-s/--seq",
    "skv": "-s/--seq",
    "d": "-d/--head-dim",
}


def _check_numbers(args: argparse.Namespace) -> None:
    """The number flags, checked before a GPU is looked for (a bad number is a usage error on
    every machine), whichever section reads them; shape strings are checked as they are parsed."""
    problems = range_problems(_flag_shape(args), FLAGS)
    gpus = args.context_parallel
    if gpus is not None and gpus < 1:
        problems.append(f"--context-parallel: {gpus}; give the number of GPUs to shard over (>= 1)")
    elif gpus is not None and args.seq >= 1 and args.seq % (2 * gpus):  # the ring's zigzag: 2 chunks per rank
        problems.append(f"-s/--seq: {args.seq}; --context-parallel {gpus} needs a multiple of {2 * gpus}")
    if problems:
        raise ValidationError(problems)


def _flag_shape(args: argparse.Namespace) -> Shape:
    """The shape the number flags describe (what runs when no shape is given)."""
    return Shape(
        b=args.batch,
        h=args.heads,
        hkv=args.kv_heads,
        sq=args.seq,
        skv=args.seq,
        d=args.head_dim,
        dtype=args.dtype,
        causal=args.causal,
        bwd=args.bwd,
    )


def _check_plot_format(path: str) -> None:
    """A ``--plot`` name matplotlib would refuse (or rename) is a usage error before anything is
    measured, not a ``ValueError`` from ``savefig`` at the end."""
    problem = charts.format_problem(path)
    if problem:
        raise usage(f"cudnn-attn bench: --plot {path}: {problem}")


def requested(args: argparse.Namespace) -> list[str]:
    """The sections this command line runs, named as the report and ``charts`` name them. A
    section that runs by itself, asked for beside anything else, is a usage error rather than
    the others dropped."""
    alone = ["--dtype fp8"] * (args.dtype == "fp8") + ["--context-parallel"] * (args.context_parallel is not None)
    alone += [_flag(name) for name in ALONE if getattr(args, name)]
    others = ["shapes"] * bool(args.shapes) + ["--grid"] * args.grid
    others += [_flag(name) for name in (*TARGETS, "overhead", "cold_start") if getattr(args, name)]
    if len(alone) > 1 or (alone and others):
        raise usage(
            f"cudnn-attn bench: {alone[0]} runs by itself; drop {', '.join(alone[1:] + others)} "
            "(or run each in a command of its own)"
        )
    if args.dtype == "fp8":
        return ["fp8"]
    if args.context_parallel is not None:
        return ["context_parallel"]
    for name in ALONE:
        if getattr(args, name):
            return [name]
    names = ["attention"] if _shapes(args) else []
    names += [name for name in TARGETS if getattr(args, name)]
    return names + ["overhead"] * args.overhead + ["cold_start"] * args.cold_start


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# The flags that describe the one shape run when neither shapes nor --grid name them.
SHAPE_FLAGS = ("batch", "heads", "kv_heads", "seq", "head_dim", "dtype", "causal", "bwd")


def _shapes(args: argparse.Namespace) -> list[Shape]:
    given = [parse(s) for s in args.shapes]  # checked whatever runs: a bad shape is a usage error
    if given or args.grid:  # the shape flags would be dropped: refused instead, as shapes beside --grid are
        defaults = vars(parser.bench().parse_args([]))
        dropped = [name for name in SHAPE_FLAGS if getattr(args, name) != defaults[name]]
        if dropped:
            whose = "--grid runs the standard grid of shapes" if args.grid else "the shapes given name their own"
            flags = ", ".join(_flag(name) for name in dropped)
            raise usage(f"cudnn-attn bench: {whose}; drop {flags} (or write them into a shape)")
    if args.grid:
        if given:  # both name the shapes to run: one is refused rather than the other dropped
            raise usage("cudnn-attn bench: --grid runs the standard grid of shapes; drop the shapes (or --grid)")
        return [parse(s) for s in STANDARD_GRID]
    if given:
        return given
    if any(getattr(args, name) for name in TARGETS):
        return []  # the sections bring their own shapes
    return [_flag_shape(args)]


def _redraw(args: argparse.Namespace) -> int:
    if not args.plot:
        raise usage("cudnn-attn bench: --plot-from needs --plot OUT.png")
    defaults = vars(parser.bench().parse_args([]))
    measuring = [k for k, v in defaults.items() if k not in ("plot", "plot_from") and getattr(args, k) != v]
    if measuring:  # it measures nothing: a flag that would is refused, not ignored
        flags = ", ".join("--" + k.replace("_", "-") if k != "shapes" else "shapes" for k in measuring)
        raise usage(f"cudnn-attn bench: --plot-from redraws a saved report; it takes no {flags}")
    try:
        report = read_json(args.plot_from)
    except (OSError, ValueError) as error:  # missing, unreadable, or not JSON
        raise usage(f"cudnn-attn bench: cannot read --plot-from {args.plot_from}: {error}") from error
    try:
        charts.panels(report)  # a report with nothing to draw is refused before matplotlib is asked for
        _needs_matplotlib()
        _check_plot_format(args.plot)
        _draw(report, args.plot)  # refuses, as panels does, values only drawing meets
    except charts.NoChartError as error:
        raise usage(f"cudnn-attn bench: --plot-from {args.plot_from}: {error}") from error
    return 0


def _draw(report: dict, path: str) -> None:
    """``charts.draw``; an image that fails as it is written (a full disk, /dev/full) is a usage
    error naming ``--plot``, as ``--json``'s is, not a traceback."""
    try:
        charts.draw(report, path)
    except OSError as error:
        raise usage(f"cudnn-attn bench: --plot {path}: cannot be written ({error.strerror or error})") from error


def _needs_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise environment('cudnn-attn bench: --plot needs matplotlib: pip install "cudnn-attn[plot]"')


def _needs_continuous_batching() -> None:
    """--batching serves through transformers' continuous batching, configured by its
    ``ContinuousBatchingConfig`` (transformers 5)."""
    try:
        import transformers

        ready = hasattr(transformers, "ContinuousBatchingConfig")
    except ImportError:
        ready = False
    if not ready:
        raise environment(
            "cudnn-attn bench: --batching needs transformers with continuous batching (5.x, "
            "ContinuousBatchingConfig): pip install 'transformers>=5'"
        )


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the sections asked for; their figures as one report, with the GPU's name."""
    if args.dtype == "fp8":
        from ..bench import fp8

        rows = fp8.fp8_rows()
        print(fp8.format_fp8(rows))
        crossover = fp8.crossover()
        print(fp8.format_crossover(crossover))
        accuracy = fp8.accuracy()
        print(fp8.format_accuracy(accuracy))
        return {**_device(), "fp8": rows, "crossover": crossover, "accuracy": accuracy}
    if args.context_parallel is not None:
        return _context_parallel(args)
    if args.serving:
        from ..bench import prefill, serving

        rows = serving.serving_rows(page=args.page or serving.PAGE)
        print(serving.format_serving(rows))
        prefill_row = {**prefill.prefill_row(), "memory": prefill.prefill_memory()}
        print(prefill.format_prefill(prefill_row))
        return {**_device(), "serving": rows, "prefill": prefill_row}
    if args.mla:
        from ..bench import mla

        return {**_device(), **mla.mla_rows()}
    if args.models:
        from ..bench import model_shapes

        models = model_shapes.model_rows()
        print(model_shapes.format_models(models))
        return {**_device(), "models": models}
    if args.batching:
        from ..bench import batching

        served = batching.measure()
        print(batching.format_batching(served))
        return {**_device(), "batching": served}
    if args.score_terms:
        from ..bench import score_terms

        terms = score_terms.score_term_rows()
        print(score_terms.format_score_terms(terms))
        return {**_device(), "score_terms": terms}
    if args.frontend_rebuild:
        from ..bench import frontend_rebuild

        rebuild = frontend_rebuild.rebuild_loop()
        print(frontend_rebuild.format_rebuild(rebuild))
        return {**_device(), **rebuild}
    if args.varlen:
        from ..bench import varlen

        memory = varlen.packed_memory()  # first: its plans are fresh, as a training job's first step
        print(varlen.format_memory(memory))
        mixed, plans = varlen.mixed_batch(), varlen.plans_over_packings()
        llama = varlen.llama_step() if importlib.util.find_spec("transformers") else None
        print(varlen.format_varlen(mixed, plans, llama))
        return {**_device(), "memory": memory, "mixed": mixed, "plans": plans, "llama": llama}
    from ..bench import attention

    sections = {name: getattr(args, name) for name in TARGETS}
    return attention.run(
        _shapes(args), json_path=None, plot_path=None, overhead=args.overhead, cold=args.cold_start, **sections
    )


def _device() -> dict[str, str]:
    import torch

    return {"device": torch.cuda.get_device_name()}


def _context_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """The ring benchmark runs its ranks in processes of its own and writes its report to a file;
    read back here, it is written and drawn as every other section's."""
    import torch

    from ..bench import context_parallel

    gpus = args.context_parallel
    if torch.cuda.device_count() < max(gpus, 2):
        raise environment(
            f"cudnn-attn bench: --context-parallel {gpus} needs {max(gpus, 2)} CUDA GPUs "
            f"({torch.cuda.device_count()} here)"
        )
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "context_parallel.json")
        options = [
            "--gpus",
            str(gpus),
            "--seq",
            str(args.seq),
            "--heads",
            str(args.heads),
            "--head-dim",
            str(args.head_dim),
            "--mode",
            args.cp_mode or "p2p",
            "--json",
            path,
        ]
        options += ["--packed"] if args.packed else []
        code = context_parallel.main(options)
        if code:  # its own checks of --seq against the ranks: a usage error, said on stderr already
            raise usage(f"cudnn-attn bench: --context-parallel {gpus} refused its options (exit {code})")
        return read_json(path)
