"""Which backend runs a problem: a priority list per device, every refusal collected.

A backend says what it cannot run as ``not_supported_reasons(problem)``. ``select`` tries the
backends of the problem's device in order (or the one asked for by name) and takes the first
with no reasons; each backend passed over is logged at debug with its reasons, and when none
runs the problem one ``UnsupportedError`` lists every backend's reasons (xformers'
``_run_priority_list``, TransformerEngine's ``get_attention_backend``).

The same list chooses a paged decode step's kernel (``select_decode``): cuDNN's paged calls or
the Triton decode and MLA kernels. ``ops/`` may not import ``kernels/``, so serving hands in
the kernels' support facts as data (``decode_step.DecodeStep``) rather than registering
callbacks: the candidates stay named here, in one table beside the others, and the choice is a
pure function of values that a test states without a GPU.

This is the only place backend names are told apart: other layers hold a ``Backend`` (or a
``DecodeKernel``) and read its attributes (``tunable``, ``stores_plans``, ``one_kernel``), or
pass a name along.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import log
from ..core.mask import default_scale
from ..core.problem import AttentionProblem
from ..errors import UnsupportedError
from . import decode_step
from .base import Backend
from .decode_step import DecodeStep
from .reference.backend import ReferenceBackend
from .torch import cudnn_op, kernel, reasons
from .torch.call import Call

BACKENDS = ("cudnn", "reference", "torch")
BACKEND_NAMES = ("auto", *BACKENDS)
# The backend names whose graphs take per-sequence lengths (padding masks): torch's kernel takes none.
LENGTHS_BACKEND_NAMES = tuple(name for name in BACKEND_NAMES if name != "torch")

# The backends "auto" tries for a problem (a Graph's node, a varlen or serving call), in order. The
# reference is no fallback for CUDA tensors: it is slow, and a GPU user asks for it by name.
PRIORITY: dict[str, tuple[str, ...]] = {"cuda": ("cudnn",), "cpu": ("reference",)}

# Where each backend's plans can run: a restored plan (a graph's serialize()) is checked against it.
DEVICES: dict[str, tuple[str, ...]] = {"cudnn": ("cuda",), "reference": ("cuda", "cpu"), "torch": ("cuda", "cpu")}

_backends: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend instance called ``name`` (one of ``BACKENDS``); created once."""
    if name not in _backends:
        if name == "reference":
            _backends[name] = ReferenceBackend()
        elif name == "cudnn":
            from .cudnn.backend import CudnnBackend  # the frontend is imported lazily

            _backends[name] = CudnnBackend()
        elif name == "torch":
            from .torch.backend import TorchBackend

            _backends[name] = TorchBackend()
        else:
            raise ValueError(f"backend: {name!r}; allowed {', '.join(BACKEND_NAMES)}")
    return _backends[name]


def device_kind(device: str) -> str:
    """``"cuda"`` or ``"cpu"``: the key of the priority lists (``"cuda:1"`` -> ``"cuda"``)."""
    return "cuda" if device.startswith("cuda") else "cpu"


def runs_on(name: str, device: str) -> bool:
    """Whether backend ``name``'s plans run on tensors of ``device``."""
    return device_kind(device) in DEVICES.get(name, ())


def candidates(requested: str, device: str) -> tuple[str, ...]:
    """The backends tried for ``requested`` ("auto": the device's priority list; a name: that one)."""
    return PRIORITY[device_kind(device)] if requested == "auto" else (requested,)


def select(problem: AttentionProblem, requested: str = "auto") -> Backend:
    """The first backend of ``candidates(requested, problem.device)`` that runs ``problem``;
    ``UnsupportedError`` listing every candidate's reasons when none does."""
    names = candidates(requested, problem.device)
    chosen, _ = _run_priority_list(
        names,
        lambda name: get_backend(name).not_supported_reasons(problem),
        where=problem.describe,
        context=lambda refused: f"{refused} backend, {problem.describe()}",
        alternatives=lambda: [] if names == ("reference",) else [_reference_hint(problem)],
    )
    return get_backend(chosen)


def _run_priority_list(
    names: Sequence[str],
    reasons_of: Callable[[str], list[str]],
    *,
    where: Callable[[], str],
    context: Callable[[str], str],
    alternatives: Callable[[], list[str]],
) -> tuple[str, list[tuple[str, list[str]]]]:
    """The first of ``names`` whose ``reasons_of`` is empty, and those passed over before it with
    their reasons. Each one passed over is logged at debug (``where()``: what was asked); when none
    is left, one ``UnsupportedError`` lists every one's reasons (prefixed by its name where there
    were several), with ``context(names)``."""
    refused: list[tuple[str, list[str]]] = []
    for name in names:
        found = reasons_of(name)
        if not found:
            return name, refused
        if not torch.compiler.is_compiling():  # dynamo traces no logger call
            log.backend_skipped(where, name, found)
        refused.append((name, found))
    if len(refused) == 1:
        lines = refused[0][1]
    else:
        lines = [f"{name}: {reason}" for name, reasons in refused for reason in reasons]
    raise UnsupportedError(lines, context=context(" and ".join(names)), alternatives=alternatives())


def _reference_hint(problem: AttentionProblem) -> str:
    """What would work instead, phrased so that following it works."""
    import torch

    if problem.device.startswith("cuda") and not torch.cuda.is_available():
        return (
            "no CUDA device is visible here: give CPU tensors (or Graph.tensor(..., device='cpu')) "
            "to run on the reference backend"
        )
    return 'backend="reference" runs every valid problem on these tensors (slowly)'


# A call of torch's SDPA signature (``cudnn_attn.sdpa``): the engines tried, by block and device.
# "torch_cudnn" is torch's cuDNN attention op (training calls it serves: a C++ autograd node), then
# cuDNN's graphs, then torch's SDPA kernel for what cuDNN lacks or serves worse. On the CPU the
# reference passes plain calls over for torch's kernel, 5-35x faster (``ops/torch/reasons.py``).
CALL_PRIORITY: dict[str, dict[str, tuple[str, ...]]] = {
    "auto": {"cuda": ("torch_cudnn", "cudnn", "torch"), "cpu": ("reference", "torch")},
    "cudnn": dict.fromkeys(("cuda", "cpu"), ("torch_cudnn", "cudnn")),
    "reference": dict.fromkeys(("cuda", "cpu"), ("reference", "torch")),
    "torch": dict.fromkeys(("cuda", "cpu"), ("torch",)),
}
GRAPHS = ("cudnn", "reference")  # engines whose plans the door prepares (``runtime.prepare``)


@dataclass(frozen=True)
class CallChoice:
    """What runs a call: the ``backend`` whose graphs the door prepares, or ``run``, torch's
    kernel taking the call's own tensors. ``as_graph``: torch's kernel stands in for the graphs,
    so the call is checked as they would check it (code that runs on the CPU runs on a GPU)."""

    backend: str | None
    run: Callable[..., torch.Tensor] | None
    as_graph: bool


def select_call(call: Call, requested: str, torch_op: bool = True) -> CallChoice:
    """The engine for ``call`` under the block's ``requested`` backend. ``torch_op``: torch's cuDNN
    op may take it (eager calls; the compile op has its own autograd). ``UnsupportedError``
    listing every engine's reasons where none runs it (only a "cudnn" block refuses)."""
    names = CALL_PRIORITY[requested][device_kind(call.query.device.type)]
    if not torch_op:
        names = tuple(n for n in names if n != "torch_cudnn")
    asked = requested != "auto"
    reasons_of = {
        "torch_cudnn": lambda: cudnn_op.reasons(call),
        "cudnn": lambda: reasons.cudnn(call, asked),
        "reference": lambda: reasons.reference(call, asked),
        "torch": lambda: [],
    }
    chosen, refused = _run_priority_list(
        names,
        lambda name: reasons_of[name](),
        where=call.describe,
        context=lambda _: "sdpa" if not asked else f'sdpa under cudnn_attn.backend("{requested}")',
        alternatives=lambda: ['cudnn_attn.backend("auto") runs it on torch\'s kernel'],
    )
    if chosen in GRAPHS:
        return CallChoice(chosen, None, as_graph=False)
    if chosen == "torch_cudnn":
        scale = float(call.scale) if call.scale is not None else default_scale(call.query.shape[-1])
        return CallChoice(None, cudnn_op.TorchCudnnOp(scale, call.causal), as_graph=False)
    passed = [reason for name, found in refused if name in GRAPHS for reason in found]
    why = passed[0] if passed else 'cudnn_attn.backend("torch")'
    stands_in = all(reason == reasons.ON_CPU for reason in passed)  # the graphs lack nothing here
    if stands_in:  # torch's own kernel choice, but its CPU flash kernel gives NaN for a scale < 0
        math = not call.scale_positive
    else:  # on the CPU, or for a scale <= 0, its exact math kernel
        exact = (reasons.NON_POSITIVE_SCALE, reasons.NON_FINITE_SCALE, *reasons.DEGENERATE)
        math = not call.on_gpu or any(r in passed for r in exact)
    run = kernel.TorchKernel(why, call.dropout_p, call.causal, call.scale, call.enable_gqa, math)
    return CallChoice(None, run, as_graph=stands_in)


@dataclass(frozen=True)
class DecodeKernel:
    """What runs a paged decode step, as serving reads it: ``name`` (``decode_kernel=``,
    ``Schedule.kernel``) and ``one_kernel``: one kernel packs, splits and masks the whole step
    itself (ours, in ``kernels/``), where cuDNN's paged calls run each part apart, merged after."""

    name: str
    one_kernel: bool


# cuDNN's paged calls go through ``runtime.prepare``, so ``select`` above picks their backend
# (the reference on the CPU). Prefill always takes them.
PAGED_CALLS = DecodeKernel("cudnn", one_kernel=False)
DECODE_KERNELS = {kernel.name: kernel for kernel in (PAGED_CALLS, DecodeKernel("triton", one_kernel=True))}

# The kernels tried for a decode step, by ``decode_kernel=`` ("auto" for None) and device. Ours
# first where it serves: measured faster than cuDNN's calls at every shape of ``bench --serving``.
# Asked for by name, the Triton kernel must run here, but a step it cannot lay out runs cuDNN's.
DECODE_PRIORITY: dict[str, dict[str, tuple[str, ...]]] = {
    "auto": {"cuda": ("triton", "cudnn"), "cpu": ("cudnn",)},
    "cudnn": dict.fromkeys(("cuda", "cpu"), ("cudnn",)),
    "triton": dict.fromkeys(("cuda", "cpu"), ("triton", "cudnn")),
}


def select_decode(step: DecodeStep, requested: str = "auto") -> DecodeKernel:
    """The kernel for ``step`` under ``decode_kernel=requested``: the first of
    ``DECODE_PRIORITY[requested]`` for its device that lays it out. ``UnsupportedError`` where the
    kernel asked for by name cannot run here at all (or, a list changed, none runs the step)."""
    asked = requested != "auto"
    where = step.describe
    if asked:  # a kernel asked for that cannot run here at all is an error, never a fallback
        cannot_run = {"cudnn": lambda: [], "triton": lambda: decode_step.cannot_run(step, asked)}
        _run_priority_list(
            (requested,),
            lambda name: cannot_run[name](),
            where=where,
            context=lambda _: "PagedAttention",
            alternatives=lambda: [
                "decode_kernel=None or " + " or ".join(repr(n) for n in DECODE_KERNELS if n != requested)
            ],
        )
    reasons_of = {
        "cudnn": lambda: [],
        "triton": lambda: [
            *decode_step.cannot_run(step, asked),
            *decode_step.cannot_lay_out(step),
            *([] if asked else decode_step.prefers_not(step)),
        ],
    }
    chosen, _ = _run_priority_list(
        DECODE_PRIORITY[requested][device_kind(step.device)],
        lambda name: reasons_of[name](),
        where=where,
        context=lambda names: f"{names} decode kernel, PagedAttention",
        alternatives=lambda: [],
    )
    return DECODE_KERNELS[chosen]
