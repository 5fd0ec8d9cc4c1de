"""A seeded fuzz campaign over every public attention op: valid and malformed requests.

``make_case(op, seed)`` turns (op, seed) into one reproducible request: a valid one (which must
match the independent float64 oracle within the dtype's tolerance), a malformed one (which must
raise a library error: ``ValidationError``, ``UnsupportedError``, ``ShapeMismatchError``, or
``GraphStateError`` for misuse), or, where the contract leaves the choice open, an ``either`` one
(a library error, or a correct result). ``run_case`` runs it under a per-case time limit and
returns its findings: any other exception, a hang, NaN, or a wrong or unwritten result.

Replay from the command line (prints the request and its findings)::

    python tests/fuzz_requests.py sdpa 123             # one case
    python tests/fuzz_requests.py sdpa 100-199         # a test item's cases, in order (they share plan caches)
    python tests/fuzz_requests.py --summary            # every op: counts, open requests, findings by class
    python tests/fuzz_requests.py --gpu sdpa 123       # the same case on the GPU (cuDNN)
    python tests/fuzz_requests.py --gpu --summary      # the GPU campaign's counts (see test_gpu_fuzz.py)
    python tests/fuzz_requests.py --harness --summary  # the GPU campaign's harness, run on the CPU

Ops: ``sdpa`` (dense layouts, GQA/MQA, causal, windows, bias, ALiBi, padding, dropout),
``sdpa_thd`` (ragged), ``sdpa_backward``, ``paged`` (``sdpa_with_paged_cache``), ``functional``
(``cudnn_attn.sdpa``), ``fp8`` (``Graph.sdpa_fp8`` and ``cudnn_attn.sdpa_fp8``) and ``dropout``
(dropout checked statistically: kept fraction, scale, mean over seeds, seed semantics, gradients).

On the GPU (``target="cuda"``) a case is made exactly as on the CPU (CPU generator, CPU tensors,
the same float64 oracle); only at the library's door are its tensors copied to the GPU
(``Boundary``: layouts, offsets, aliasing and autograd kept) and its results copied back. The
GPU's own rules: a valid request that cuDNN cannot run must be refused with an
``UnsupportedError`` naming why (counted apart, and re-run with the library's rules switched off
to see whether cuDNN would have run it: ``probe_refusals``); values of lengths and page tables
on the GPU are clamped, not checked (``core/bounds.py``), so requests malformed only in those values
may run there.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracle  # noqa: E402
from conftest import REFERENCE_TOL, TOLERANCE, rel_err  # noqa: E402

import cudnn_attn  # noqa: E402

VALID, MALFORMED, EITHER = "valid", "malformed", "either"
REQUEST_ERRORS = (cudnn_attn.ValidationError, cudnn_attn.UnsupportedError, cudnn_attn.ShapeMismatchError)
MISUSE_ERRORS = REQUEST_ERRORS + (cudnn_attn.GraphStateError,)
LIBRARY_ERRORS = MISUSE_ERRORS
CASE_TIMEOUT_S = 10
DEVICE_CASE_TIMEOUT_S = 60  # a first cuDNN build of a kind can take seconds; a hang is far longer
HALF = (torch.float16, torch.bfloat16)
# The dtypes a request is drawn in. float32 joins this list once the library takes it everywhere
# torch's SDPA does (issue 18); tolerances come from conftest.TOLERANCE by dtype.
IO_DTYPES = HALF
# Gradients are checked against the float64 formula given the o that was passed (as fused kernels
# compute them), at the output tolerance; the formula is itself checked against autograd of the oracle.

OPS = {"sdpa": 8, "sdpa_thd": 3, "sdpa_backward": 6, "paged": 5, "functional": 8, "fp8": 2, "dropout": 1}
CHUNK = 100


# ---- running a case ------------------------------------------------------------------------------


class CaseTimeout(BaseException):  # noqa: N818 - BaseException: a library ``except Exception`` cannot swallow it
    """A case ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ``CaseTimeout`` in the main thread after ``seconds`` (SIGALRM; no limit off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _fire(signum, frame):
        raise CaseTimeout(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Target:
    """Where a campaign's requests run. ``device``: the tensors the library sees; ``boundary``: the
    case is made on the CPU and its tensors are copied at the library's door (``Boundary``), as
    the GPU campaign does; with ``device="cpu"`` that harness runs on the CPU (its own test)."""

    name: str
    device: str
    boundary: bool


TARGETS = {
    "cpu": Target("cpu", "cpu", False),
    "cuda": Target("cuda", "cuda", True),
    "cpu-harness": Target("cpu-harness", "cpu", True),
}
_generating = TARGETS["cpu"]  # the target of the case being made (make_case sets it)


def gpu_like() -> bool:
    """The case being made will meet the library through the boundary (no numpy arrays, say)."""
    return _generating.boundary


def on_cuda() -> bool:
    """The case being made runs on cuDNN."""
    return _generating.device == "cuda"


def own_backend() -> str:
    """The backend a case names explicitly: the reference on the CPU, cuDNN on the GPU."""
    return "cudnn" if on_cuda() else "reference"


@dataclass
class Case:
    op: str
    seed: int
    expect: str  # VALID | MALFORMED | EITHER
    label: str  # the request's class: what a finding is grouped by
    desc: str  # the full request, for the failure message
    call: Callable[[Case], Any]  # makes the request (build and run); returns the results
    check: Callable[[Any], None] | None = None  # judges a result against the oracle (AssertionError)
    errors: tuple = REQUEST_ERRORS  # what a malformed request may raise
    notes: list[Finding] = field(default_factory=list)  # findings recorded by ``call`` itself
    outcome: str = ""  # "ran" or "refused: <error class>", once run
    names: tuple = ()  # arguments a refusal must name (section 4: "the argument, what was given, ...")
    target: Target = TARGETS["cpu"]
    host: tuple = ()  # tensors the boundary leaves on the CPU (a mixed-device request)
    host_only: bool = False  # the boundary copies nothing (CPU tensors on purpose)
    refusal: str = ""  # a valid request's UnsupportedError on the GPU: its first reason

    def note(self, kind: str, detail: str, label: str | None = None) -> None:
        self.notes.append(Finding(self.op, self.seed, label or self.label, kind, detail, self.desc))


@dataclass
class Finding:
    op: str
    seed: int
    label: str
    kind: str
    detail: str
    desc: str

    @property
    def key(self) -> str:
        """The class a finding is grouped in: valid requests by what went wrong (numbers blanked),
        malformed ones by their mutation."""
        detail = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", self.detail)
        detail = re.sub(r"^(graph|sdpa[^:]*): (N problems: \| - )?", "", detail)[:90]
        if "/valid" in self.label and self.kind == "wrong result":
            return f"{self.op} | {self.label} | {self.kind} | {detail}"
        if "/valid" in self.label:
            return f"{self.op} | {self.label.split('/valid')[0]}/valid | {self.kind} | {detail}"
        return f"{self.op} | {self.label} | {self.kind}"

    def line(self) -> str:
        return f"seed {self.seed} [{self.label}]: {self.kind}: {self.detail}\n      request: {self.desc}"


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    lib = [f for f in frames if "cudnn_attn" in f.filename and "tests" not in f.filename]
    frame = (lib or frames or [None])[-1]
    return "" if frame is None else f" (at {Path(frame.filename).name}:{frame.lineno})"


def _first_line(error: BaseException) -> str:
    text = " | ".join(line.strip() for line in str(error).strip().splitlines())
    return text[:300]


def run_case(case: Case) -> list[Finding]:
    """Run ``case`` under the time limit; every way it deviates from its expectation is a finding.

    On the GPU, a valid request refused with an ``UnsupportedError`` that names a reason is no
    finding here: cuDNN may not run it on this machine. It is counted apart (``case.outcome ==
    "unsupported"``, ``case.refusal``) and judged by ``probe_refusals``."""
    global _boundary, _running_on

    def found(kind: str, detail: str) -> list[Finding]:
        return case.notes + [Finding(case.op, case.seed, case.label, kind, detail, case.desc)]

    target = case.target
    boundary = Boundary(target.device, case.host, copy_nothing=case.host_only) if target.boundary else None
    limit = DEVICE_CASE_TIMEOUT_S if target.device == "cuda" else CASE_TIMEOUT_S
    previous = _boundary, _running_on
    _boundary, _running_on = boundary, target.device
    try:
        with time_limit(limit):
            if target.device == "cuda":
                poison_allocator()
            try:
                result = case.call(case)
                if target.device == "cuda":
                    torch.cuda.synchronize()  # a kernel's fault shows in this case, not a later one
                case.outcome = "ran"
            except LIBRARY_ERRORS as error:
                case.outcome = f"refused: {type(error).__name__}"
                if case.expect == VALID:
                    if target.device == "cuda" and isinstance(error, cudnn_attn.UnsupportedError):
                        case.outcome, case.refusal = "unsupported", _first_line(error)
                        if not error.problems or not all(isinstance(p, str) and p.strip() for p in error.problems):
                            return found("UnsupportedError without a reason", repr(error))
                        return case.notes
                    return found(f"valid request refused ({type(error).__name__})", _first_line(error))
                if not isinstance(error, case.errors):
                    return found(f"wrong error class {type(error).__name__}", _first_line(error))
                if not str(error).strip():
                    return found("library error with an empty message", repr(error))
                if (
                    case.names
                    and not isinstance(error, cudnn_attn.GraphStateError)
                    and not _names_any(str(error), case.names)
                ):
                    return found(
                        f"{type(error).__name__} does not name the argument",
                        f"expected one of {list(case.names)} in: {_first_line(error)}",
                    )
                return case.notes
            except (CaseTimeout, KeyboardInterrupt):
                raise
            except Exception as error:  # noqa: BLE001 - any other exception is the finding
                case.outcome = f"raised: {type(error).__name__}"
                return found(f"raised {type(error).__name__}", _first_line(error) + _where(error))
            if boundary is not None and boundary.wrong_device:
                return found("result on the wrong device", "; ".join(boundary.wrong_device[:3]))
            if case.expect == MALFORMED:
                return found("malformed request accepted", f"returned {_describe_result(result)}")
            if case.check is not None:
                try:
                    case.check(result)
                except AssertionError as error:
                    return found("wrong result", _first_line(error))
                except (CaseTimeout, KeyboardInterrupt):
                    raise
                except Exception as error:  # noqa: BLE001
                    return found(f"unusable result ({type(error).__name__})", _first_line(error) + _where(error))
    except CaseTimeout as error:
        return found("timeout", str(error))
    finally:
        _boundary, _running_on = previous
    return case.notes


# ---- the library's door on another device -----------------------------------------------------------

_boundary: Boundary | None = None  # the running case's boundary, when it has one
_running_on = "cpu"  # the device the running case's library calls see


class _ToDevice(torch.autograd.Function):
    """A CPU tensor that requires grad, seen on the device: the twin made by ``make`` (its layout
    kept), the gradient carried back to the CPU."""

    @staticmethod
    def forward(ctx, x, make):  # type: ignore[override]
        ctx.home = x.device
        return make()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.to(ctx.home), None


class Boundary:
    """Copies a case's tensors to ``device`` as they enter the library and its results back.

    Each CPU storage is copied once, whole, and every tensor becomes a view of its copy with the
    same shape, strides and offset: padded and offset buffers keep their NaN surroundings, packed
    QKV stays packed, an expanded view stays expanded, one tensor passed twice stays one tensor.
    A tensor that requires grad is copied differentiably (its gradient comes back to the CPU).
    A result that is a view of a copied storage (an ``out=`` buffer) is copied back into the CPU
    original and returned as that view, so "the result is the out= buffer" still holds; other
    results are copied to the CPU with their strides. A result that is not on the device its
    inputs were on is recorded (``wrong_device``)."""

    def __init__(self, device: str, host: tuple = (), copy_nothing: bool = False):
        self.device = torch.device(device)
        self.host = host
        self.copy_nothing = copy_nothing
        self.wrong_device: list[str] = []
        self._storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # CPU storage -> (its bytes, their copy)
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(CPU tensor) -> (it, its twin)

    def call(self, fn: Callable, *args: Any, results_back: bool = True, **kwargs: Any) -> Any:
        args, kwargs = self.inward(args), self.inward(kwargs)
        devices = {x.device.type for x in _flat_tensors((args, kwargs)) if x.device.type != "meta"}
        result = fn(*args, **kwargs)
        if not results_back:
            return result
        return self.outward(result, devices.pop() if len(devices) == 1 else None)

    def inward(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._twin_of(value)
        if isinstance(value, tuple):
            return tuple(self.inward(v) for v in value)
        if isinstance(value, list):
            return [self.inward(v) for v in value]
        if isinstance(value, dict):
            return {k: self.inward(v) for k, v in value.items()}
        return value

    def _twin_of(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_nothing or x.device.type != "cpu" or any(x is h for h in self.host):
            return x
        known = self._tensors.get(id(x))
        if known is not None:
            return known[1]

        def make() -> torch.Tensor:
            storage = x.untyped_storage()
            if storage.nbytes() == 0:
                return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device=self.device)
            pair = self._storages.get(storage.data_ptr())
            if pair is None:
                raw = torch.empty(0, dtype=torch.uint8).set_(storage)
                pair = self._storages[storage.data_ptr()] = (raw, raw.to(self.device, copy=True))
            twin = torch.empty(0, dtype=x.dtype, device=self.device)
            return twin.set_(pair[1].untyped_storage(), x.storage_offset(), tuple(x.shape), x.stride())

        twin = _ToDevice.apply(x, make) if x.requires_grad and torch.is_grad_enabled() else make()
        self._tensors[id(x)] = (x, twin)
        return twin

    def outward(self, value: Any, expected_device: str | None) -> Any:
        if isinstance(value, torch.Tensor):
            return self._home_of(value, expected_device)
        if isinstance(value, tuple):
            return tuple(self.outward(v, expected_device) for v in value)
        if isinstance(value, list):
            return [self.outward(v, expected_device) for v in value]
        if isinstance(value, dict):
            return {k: self.outward(v, expected_device) for k, v in value.items()}
        return value

    def _home_of(self, r: torch.Tensor, expected_device: str | None) -> torch.Tensor:
        if r.device.type == "meta":
            return r
        if expected_device is not None and r.device.type != expected_device:
            self.wrong_device.append(f"a result {list(r.shape)} on {r.device}, its inputs on {expected_device}")
        if r.device.type == "cpu" and self.device.type != "cpu":
            return r
        for raw, copy in self._storages.values():
            if not r.requires_grad and r.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr():
                raw.copy_(copy)  # an out= buffer (or an alias of an input): the CPU original gets the values
                home = torch.empty(0, dtype=r.dtype)
                return home.set_(raw.untyped_storage(), r.storage_offset(), tuple(r.shape), r.stride())
        return r if r.device.type == "cpu" else r.to("cpu")  # strides kept (dense results)


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


class _GraphAtTheDoor:
    """A ``Graph`` whose recording calls and runs pass the running case's boundary."""

    RECORDING = ("sdpa", "sdpa_backward", "sdpa_with_paged_cache", "sdpa_fp8", "sdpa_fp8_backward", "tensor_like")

    def __init__(self, graph: cudnn_attn.Graph, boundary: Boundary):
        self._graph, self._boundary = graph, boundary

    def __enter__(self) -> _GraphAtTheDoor:
        self._graph.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._graph.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._graph, name)
        if name in self.RECORDING:
            return functools.partial(self._boundary.call, attr, results_back=False)
        return attr

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._boundary.call(self._graph, *args, **kwargs)

    def __repr__(self) -> str:
        return repr(self._graph)


def library(fn: Callable) -> Callable:
    """``fn`` (a library function: ``cudnn_attn.sdpa``, ...) called through the running case's boundary."""

    def through(*args: Any, **kwargs: Any) -> Any:
        if _boundary is None:
            return fn(*args, **kwargs)
        return _boundary.call(fn, *args, **kwargs)

    return through


def poison_allocator() -> None:
    """Fill the CUDA caching allocator's free blocks with NaN bytes (0xFF is NaN in every float
    format used here), so outputs the library allocates and then leaves unwritten show as NaN:
    blocks of the small pool (requests up to 1 MiB) and one large block, freed again at once."""
    blocks = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]
    blocks.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    for block in blocks:
        block.fill_(0xFF)
    del blocks


def _names_any(message: str, names) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", message) for n in names)


# What a refusal of each malformed request must name (any one of them), by the mutation's label.
GRAPH_ARGUMENTS = {
    "q-": ("q",),
    "k-": ("k",),
    "v-": ("v",),
    "kv-heads": ("k", "v"),
    "k-batch": ("k", "v"),
    "headdim-": ("q", "k", "v", "d_qk", "d_v"),
    "b-0": ("q", "k", "v"),
    "sq-0": ("q",),
    "skv-0": ("k", "v"),
    "h-0": ("q", "k", "v"),
    "bias-": ("attn_bias", "bias"),
    "both-causal": ("use_causal_mask", "use_causal_mask_bottom_right"),
    "window-": ("sliding_window_length",),
    "causal-str": ("use_causal_mask",),
    "alibi-str": ("use_alibi_mask",),
    "padding-no-lengths": ("seq_len_q", "seq_len_kv", "use_padding_mask"),
    "lengths-no-padding": ("seq_len_q", "seq_len_kv", "use_padding_mask"),
    "seq-len-": ("seq_len_q", "seq_len_kv"),
    "dropout": ("dropout", "dropout_seed", "dropout_offset"),
    "attn_scale=": ("attn_scale",),
    "stats-contradiction": ("generate_stats", "is_inference"),
    "stats-flag-str": ("generate_stats",),
    "io-dtype": ("io_data_type",),
    "backend-garbage": ("backend",),
    "paged-max-without-tables": ("paged_attention_max_seq_len_kv",),
    "dO-": ("dO",),
    "o-": ("o",),
    "stats-": ("stats",),
}
FUNCTIONAL_ARGUMENTS = {
    "q-": ("query",),
    "k-": ("key",),
    "v-": ("value",),
    "mask-and-causal": ("attn_mask", "is_causal"),
    "mask-": ("attn_mask",),
    "scale=": ("scale",),
    "is_causal=": ("is_causal",),
    "dropout_p=": ("dropout_p",),
    "enable_gqa=": ("enable_gqa",),
    "e-mismatch": ("query", "key"),
    "s-mismatch": ("key", "value"),
    "batch-mismatch": ("query", "key", "value"),
    "gqa-not-dividing": ("query", "key", "value", "enable_gqa"),
    "heads-without-gqa": ("query", "key", "value", "enable_gqa"),
}
PAGED_ARGUMENTS = {
    "cache-": ("k",),
    "kv-heads": ("k", "v"),
    "v-cache-shape": ("v",),
    "table-": ("page_table", "page_table_k", "paged_attention_k_table"),
    "seq-len-kv-": ("seq_len_kv",),
    "no-seq-len-kv": ("seq_len_kv",),
    "seq-len-q-": ("seq_len_q",),
    "layout-name": ("kv_cache_layout",),
    "max-": ("max_seq_len_kv", "paged_attention_max_seq_len_kv"),
    "q-thd": ("q", "seq_len_q"),
    "table-None": ("page_table", "paged_attention_k_table", "k", "v"),  # g.sdpa without a table: k, v read as dense
}
THD_ARGUMENTS = {
    "sum-over-T": ("seq_len_q", "seq_len_kv"),
    "len-over-max": ("seq_len_q", "max_seq_len_q"),
    "len-negative": ("seq_len_kv",),
    "k-rank4": ("k",),
    "no-seq-len-kv": ("seq_len_kv",),
    "no-seq-len-q": ("seq_len_q",),
    "len-shapes-differ": ("seq_len_q", "seq_len_kv"),
    "tk-ne-tv": ("k", "v"),
    "max-": ("max_seq_len_q", "max_seq_len_kv"),
}


def arguments_for(label: str, table: dict) -> tuple:
    """The names for the longest key of ``table`` that ``label`` starts with."""
    keys = [key for key in table if label.startswith(key)]
    return table[max(keys, key=len)] if keys else ()


def name_run_inputs(case: Case, g, inputs: list, args: list, label: str) -> None:
    """A wrong run input must be named in the ShapeMismatchError (section 2) by its name in ``g.inputs``."""
    if label.startswith("run:out-"):
        case.names = ("out",) + tuple(h.name for h in getattr(g, "outputs", []))
    elif len(args) == len(inputs) and len(args) == len(g.inputs):
        changed = [j for j, (x, y) in enumerate(zip(inputs, args)) if x is not y]
        case.names = tuple(g.inputs[j].name for j in changed)


def _describe_result(result: Any) -> str:
    if isinstance(result, torch.Tensor):
        return f"tensor {list(result.shape)} {result.dtype} on {result.device}"
    if isinstance(result, (tuple, list)):
        return "(" + ", ".join(_describe_result(r) for r in result) + ")"
    if isinstance(result, np.ndarray):
        return f"ndarray {list(result.shape)} {result.dtype}"
    return type(result).__name__


def run_seed(op: str, seed: int) -> tuple[Case, list[Finding]]:
    case = make_case(op, seed)
    return case, run_case(case)


MAKERS: dict[str, Callable[[random.Random, torch.Generator], Case]] = {}  # filled below, op by op

# Malformed only in the values of lengths or page tables: on the GPU those values are clamped on
# the device, never read on the host (core/bounds.py), so such a request may run there ("either"; its
# rows are meaningless, so unchecked). On the CPU they are refused, naming the value.
DEVICE_VALUE_MUTATIONS = {
    "seq-len-too-big",
    "seq-len-negative",
    "run:lengths-range",
    "sum-over-T",
    "len-over-max",
    "len-negative",
    "table-index-high",
    "table-index-neg",
    "seq-len-kv-over",
    "seq-len-kv-neg",
    "seq-len-q-over",
}


def make_case(op: str, seed: int, target: str | Target = "cpu") -> Case:
    """The request ``(op, seed)``, made for ``target`` ("cpu", "cuda" or "cpu-harness"): the same
    tensors and oracle everywhere; on a boundary target a few choices differ (no numpy arrays, an
    explicit backend is the device's own) and so may the rest of the draw."""
    global _generating
    target = TARGETS[target] if isinstance(target, str) else target
    rng = random.Random(f"{op}:{seed}")
    gen = torch.Generator().manual_seed(rng.getrandbits(48))
    previous, _generating = _generating, target
    try:
        case = MAKERS[op](rng, gen)
    finally:
        _generating = previous
    case.op, case.seed, case.target = op, seed, target
    mutation = case.label.rsplit("/", 1)[-1]
    if target.boundary and mutation == "backend-cudnn-on-cpu":
        case.host_only = True  # CPU tensors on purpose: backend="cudnn" must refuse them
    if target.device == "cuda" and case.expect == MALFORMED and mutation in DEVICE_VALUE_MUTATIONS:
        case.expect, case.check, case.names = EITHER, None, ()
        case.label += "@gpu-values-unchecked"
    return case


def _new_case(expect: str, label: str, desc: str, call, check=None, errors=REQUEST_ERRORS) -> Case:
    return Case("", 0, expect, label, desc, call, check, errors)


# ---- tensors --------------------------------------------------------------------------------------


def randn(gen: torch.Generator, *shape: int, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


DENSE_LAYOUTS = ("BHSD", "BSHD", "SBHD", "HBSD", "padded", "offset")


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of logical ``x`` (rank 3 or 4) in another memory layout; unit last stride.

    ``padded`` lives in a wider buffer whose extra columns hold NaN: reading past the view shows.
    """
    if layout == "padded":
        buf = torch.full((*x.shape[:-1], x.shape[-1] + 8), float("nan"), dtype=x.dtype)
        buf[..., : x.shape[-1]] = x
        return buf[..., : x.shape[-1]]
    if layout == "offset":  # a view that starts inside a bigger buffer
        buf = torch.full((x.shape[0] + 1, *x.shape[1:]), float("nan"), dtype=x.dtype)
        buf[1:] = x
        return buf[1:]
    if x.dim() == 3:  # THD
        if layout in ("BSHD", "SBHD", "HBSD"):  # [T, H, D] stored head-major
            return x.transpose(0, 1).contiguous().transpose(0, 1)
        return x.contiguous()
    orders = {"BHSD": (0, 1, 2, 3), "BSHD": (0, 2, 1, 3), "SBHD": (2, 0, 1, 3), "HBSD": (1, 0, 2, 3)}
    order = orders[layout]
    inverse = [order.index(i) for i in range(4)]
    return x.permute(*order).contiguous().permute(*inverse)


def strides_like(shape, template_stride):
    order = sorted(range(len(shape)), key=lambda i: (template_stride[i], -i))
    strides, running = [0] * len(shape), 1
    for i in order:
        strides[i] = running
        running *= max(shape[i], 1)
    return tuple(strides)


def contiguous_stride(shape) -> tuple[int, ...]:
    strides, running = [], 1
    for n in reversed(shape):
        strides.append(running)
        running *= max(n, 1)
    return tuple(reversed(strides))


def poisoned(shape, stride, dtype) -> torch.Tensor:
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype).fill_(float("nan"))


def same_memory_order(a: torch.Tensor, b_stride, shape) -> bool:
    return all(n == 1 or s == t for n, s, t in zip(shape, a.stride(), b_stride))


def orthonormal_rows(gen: torch.Generator, b: int, h: int, s: int, d: int, dtype) -> torch.Tensor:
    """[B, H, S, D] whose S rows are orthonormal per (b, h) (S <= D): dropout keep-masks can then be
    read back from an output exactly (o = sum_j w_j v_j). Gram-Schmidt on random rows."""
    rows = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    for i in range(s):
        r = rows[:, :, i]
        for j in range(i):
            r = r - (r * rows[:, :, j]).sum(-1, keepdim=True) * rows[:, :, j]
        rows[:, :, i] = r / r.norm(dim=-1, keepdim=True)
    return rows.to(dtype)


def _int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---- independent float64 math (dense [B, H, S, D]) ------------------------------------------------


def scores_mask(b, h, s_q, s_kv, *, causal=None, window=None, lq=None, lkv=None) -> torch.Tensor | None:
    if causal is None and window is None and lq is None and lkv is None:
        return None
    return oracle.allowed_matrix(b, s_q, s_kv, causal=causal, window=window, seq_q=lq, seq_kv=lkv)


def alibi_bias64(h: int, s_q: int, s_kv: int) -> torch.Tensor:
    dist = torch.arange(s_kv, dtype=torch.float64).view(1, -1) - torch.arange(s_q, dtype=torch.float64).view(-1, 1)
    return oracle.alibi_slopes(h).view(1, h, 1, 1) * dist


def probs64(q, k, *, scale, allowed=None, bias=None) -> torch.Tensor:
    """Softmax probabilities [B, H, S_q, S_kv] in float64; rows with nothing allowed are 0."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    empty = torch.isneginf(m)
    e = torch.exp(s - torch.where(empty, torch.zeros_like(m), m))
    z = e.sum(-1, keepdim=True)
    return e / torch.where(z == 0, torch.ones_like(z), z)


def _group_sum(x: torch.Tensor, heads: int) -> torch.Tensor:
    *lead, h, s, d = x.shape
    return x if h == heads else x.reshape(*lead, heads, h // heads, s, d).sum(-3)


def grads64(q, k, v, o, d_o, *, scale, allowed=None, bias=None, keep=None, p=0.0):
    """(dQ, dK, dV, dS) of attention in float64, from the formula, given the ``o`` passed in."""
    q, k, v, o, d_o = (t.double() for t in (q, k, v, o, d_o))
    h_q, h_k, h_v = q.shape[-3], k.shape[-3], v.shape[-3]
    probs = probs64(q, k, scale=scale, allowed=allowed, bias=bias)
    k_full = k.repeat_interleave(h_q // h_k, dim=-3)
    v_full = v.repeat_interleave(h_q // h_v, dim=-3)
    factor = keep.double() / (1 - p) if keep is not None and p > 0 else None
    dropped = probs * factor if factor is not None else probs
    d_v = dropped.transpose(-1, -2) @ d_o
    d_p = d_o @ v_full.transpose(-1, -2)
    if factor is not None:
        d_p = d_p * factor
    delta = (d_o * o).sum(-1, keepdim=True)
    d_s = probs * (d_p - delta)
    d_q = (d_s @ k_full) * scale
    d_k = (d_s.transpose(-1, -2) @ q) * scale
    return d_q, _group_sum(d_k, h_k), _group_sum(d_v, h_v), d_s


def infer_keep(o, v, probs, p):
    """Which (row, key) pairs dropout kept, read back from the output: with orthonormal V rows,
    o[i] = sum_j w_ij v_j exactly, and w_ij is P_ij / (1 - p) where kept, 0 where dropped.

    Returns (keep, weights); ``keep`` is only meaningful where P_ij is not tiny."""
    o, v = o.double(), v.double()
    v = v.repeat_interleave(o.shape[-3] // v.shape[-3], dim=-3)
    w = o @ v.transpose(-1, -2)  # rows of v orthonormal: the projection is the solution
    return (w * (1 - p)) > probs / 2, w


def check_documented_keep(keep, probs, seed: int, offset: int, p: float) -> None:
    """semantics.md: the reference backend's keep-mask is a pure function of (seed, offset, shape).
    Where the library still exposes that function (``cudnn_attn.ops.reference.dropout.keep_mask``), the mask read
    back from O must be it (a mask that ignores the offset, say, looks random too)."""
    if _running_on == "cuda":
        return  # cuDNN draws its mask from its own Philox stream: checked statistically instead
    try:
        from cudnn_attn.ops.reference.dropout import keep_mask
    except ImportError:
        return
    expected = keep_mask(seed, offset, tuple(probs.shape), p, "cpu")
    sure = probs > 0.02
    bad = int((expected.expand_as(keep) != keep)[sure].sum())
    assert bad == 0, (
        f"dropout: {bad} of {int(sure.sum())} weights kept/dropped unlike keep_mask(seed={seed}, offset={offset})"
    )


def check_dropout_rate(keep, probs, p) -> None:
    """Dropout must drop about a fraction p of the identifiable weights (P_ij > 0.02)."""
    sure = probs > 0.02
    n = int(sure.sum())
    if n < 12:
        return
    dropped = int((~keep & sure).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(dropped - n * p) <= 6 * sigma + 1, (
        f"dropout p={p}: dropped {dropped} of {n} weights (expected ~{n * p:.1f})"
    )


# ---- checks -----------------------------------------------------------------------------------------


def tol(dtype: torch.dtype) -> float:
    return max(TOLERANCE.get(dtype, REFERENCE_TOL), REFERENCE_TOL)  # the library computes in float32


def as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    assert isinstance(x, torch.Tensor), f"expected a tensor, got {type(x).__name__}"
    return x


def assert_close(
    name: str, actual: Any, expected: torch.Tensor, tolerance: float, dtype=None, rows_zero=None, floor=0.0
):
    actual = as_tensor(actual)
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {list(actual.shape)}, expected {list(expected.shape)}"
    )
    if dtype is not None:
        assert actual.dtype == dtype, f"{name}: dtype {actual.dtype}, expected {dtype}"
    assert actual.device.type == "cpu", f"{name}: on {actual.device}, expected cpu"
    a = actual.detach().double()
    if torch.isnan(a).any():
        where = torch.isnan(a).nonzero()[0].tolist()
        raise AssertionError(f"{name}: NaN in result (first at {where}; unwritten or poisoned)")
    err = rel_err(a, expected)
    if floor and err >= tolerance:  # a result that cancels to ~0: measure against the terms summed
        err = float((a.masked_fill(torch.isinf(a), 0) - expected.masked_fill(torch.isinf(expected), 0)).norm()) / max(
            float(expected.norm()), floor
        )
    assert err < tolerance, f"{name}: rel_err {err:.3g} >= {tolerance:g}"
    if rows_zero is not None and rows_zero.any():
        bad = a[rows_zero.expand_as(a)]
        assert bad.abs().max() == 0, f"{name}: fully masked rows are not 0 (max {bad.abs().max():.3g})"


def empty_rows(allowed: torch.Tensor | None, shape) -> torch.Tensor | None:
    """Bool [B, 1|H, S_q, 1]: rows where every key is masked (their O must be exactly 0)."""
    if allowed is None:
        return None
    return ~allowed.any(-1, keepdim=True)


def unpack_outputs(result, count: int) -> list:
    if count == 1:
        assert not isinstance(result, (tuple, list)), f"expected one output, got {_describe_result(result)}"
        return [result]
    assert isinstance(result, (tuple, list)) and len(result) == count, (
        f"expected {count} outputs, got {_describe_result(result)}"
    )
    return list(result)


def check_out_buffers(results: list, outs: list | None) -> None:
    if outs is None:
        return
    for r, o in zip(results, outs):
        if o is None:
            continue
        r = as_tensor(r)
        assert r.data_ptr() == o.data_ptr() and r.stride() == o.stride(), "result is not the out= buffer"


# ---- scalar and argument catalogues -----------------------------------------------------------------

BAD_SCALES = [
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("-inf", float("-inf")),
    ("1j", 1j),
    ("10**400", 10**400),
    ("str", "0.5"),
    ("bool", True),
    ("list", [0.5]),
    ("tensor2", torch.ones(2)),
    ("None-object", object()),
]
BAD_PROBS = [
    ("1.0", 1.0),
    ("1.5", 1.5),
    ("-0.1", -0.1),
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("1j", 1j),
    ("str", "0.1"),
    ("bool", True),
    ("10**400", 10**400),
]
NON_TENSORS = [("None", None), ("list", [[1.0, 2.0]]), ("str", "q"), ("int", 3), ("float", 1.5)]


def pick(rng: random.Random, items):
    return items[rng.randrange(len(items))]


# ---- dense attention requests (Graph.sdpa / sdpa_backward) --------------------------------------------


@dataclass
class Attn:
    """One attention request in logical terms, plus the tensors that carry it."""

    dtype: torch.dtype
    b: int
    h_q: int
    h_kv: int
    s_q: int
    s_kv: int
    d_qk: int
    d_v: int
    layouts: tuple[str, str, str] = ("BHSD", "BHSD", "BHSD")
    causal: str | None = None
    window: int | None = None
    alibi: bool = False
    bias_shape: tuple | None = None
    bias_dtype: torch.dtype | None = None
    lq: list | None = None
    lkv: list | None = None
    len_shape: str = "B"
    p: float = 0.0
    rng_form: str = "int"  # int | tensor | tuple
    drop_seed: int = 0
    drop_offset: int = 0
    scale: float | None = None
    scale_form: str = "float"
    nan_beyond_len: bool = False
    packed_qkv: bool = False
    tensors: dict = field(default_factory=dict)

    @property
    def scale_value(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.d_qk)

    def describe(self) -> str:
        parts = [
            str(self.dtype).removeprefix("torch."),
            f"b{self.b}h{self.h_q}/{self.h_kv}s{self.s_q}x{self.s_kv}d{self.d_qk}/{self.d_v}",
            "layouts=" + ",".join(self.layouts) + ("(packed-qkv)" if self.packed_qkv else ""),
        ]
        if self.causal:
            parts.append(f"causal={self.causal}")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.alibi:
            parts.append("alibi")
        if self.bias_shape:
            parts.append(f"bias{list(self.bias_shape)}:{str(self.bias_dtype).removeprefix('torch.')}")
        if self.lq is not None:
            parts.append(f"seq_len_q={self.lq} seq_len_kv={self.lkv} ({self.len_shape})")
        if self.p:
            parts.append(f"dropout={self.p} seed={self.drop_seed} offset={self.drop_offset} ({self.rng_form})")
        if self.scale is not None:
            parts.append(f"scale={self.scale}({self.scale_form})")
        if self.nan_beyond_len:
            parts.append("garbage-beyond-lengths")
        return " ".join(parts)

    # logical references
    def allowed(self):
        return scores_mask(
            self.b, self.h_q, self.s_q, self.s_kv, causal=self.causal, window=self.window, lq=self.lq, lkv=self.lkv
        )

    def bias64(self):
        bias = None
        if self.bias_shape is not None:
            bias = self.tensors["bias"].double().expand(self.b, self.h_q, self.s_q, self.s_kv)
        if self.alibi:
            a = alibi_bias64(self.h_q, self.s_q, self.s_kv)
            bias = a if bias is None else bias + a
        return bias


def draw_attn(rng: random.Random, gen: torch.Generator, *, backward: bool = False) -> Attn:
    """A random, valid dense request (the validity model: the contract plus the cuDNN frontend's rules)."""
    dtype = pick(rng, IO_DTYPES)
    b = rng.choice([1, 1, 2])
    h_q = rng.choice([1, 2, 3, 4, 4])  # 3: ALiBi's slopes for head counts that are not powers of two
    h_kv = rng.choice([d for d in (1, 2, 3, 4) if h_q % d == 0])
    s_q, s_kv = rng.randint(1, 16), rng.randint(1, 16)
    d_qk = rng.choice([8, 16])
    d_v = d_qk if rng.random() < 0.8 else rng.choice([8, 16])
    a = Attn(dtype, b, h_q, h_kv, s_q, s_kv, d_qk, d_v)
    a.layouts = tuple(rng.choice(DENSE_LAYOUTS) if rng.random() < 0.5 else "BHSD" for _ in range(3))
    r = rng.random()
    if r < 0.25:
        a.causal = "top_left"
    elif r < 0.4:
        a.causal = "bottom_right"
    if rng.random() < 0.35:
        a.lq = [rng.randint(0, s_q) if rng.random() < 0.5 else s_q for _ in range(b)]
        a.lkv = [rng.randint(0, s_kv) if rng.random() < 0.6 else s_kv for _ in range(b)]
        a.len_shape = rng.choice(["B", "B", "B111"])
        a.nan_beyond_len = rng.random() < 0.1
    padded = a.lq is not None
    if a.causal == "bottom_right" and s_q > s_kv and not padded:
        a.s_q, a.s_kv = s_kv, s_q  # bottom-right needs S_q <= S_kv without per-batch lengths
    if rng.random() < 0.2:
        if a.s_q > a.s_kv and not padded:
            a.s_q, a.s_kv = a.s_kv, a.s_q
        a.window = rng.randint(1, a.s_kv + 1)
    if a.causal != "bottom_right":
        if a.causal == "top_left" and rng.random() < 0.25:
            a.alibi = True
        if rng.random() < 0.25:
            a.bias_shape = (
                rng.choice([1, b]),
                rng.choice([1, h_q]),
                rng.choice([1, a.s_q]),
                a.s_kv,
            )
            a.bias_dtype = dtype if rng.random() < 0.7 else torch.float32
        if rng.random() < 0.2:
            a.p = rng.choice([0.1, 0.25, 0.5])
            a.rng_form = rng.choice(["int", "tensor", "tuple"])
            a.drop_seed, a.drop_offset = rng.randint(0, 2**31), rng.choice([0, 0, rng.randint(1, 1000)])
            a.s_kv = min(a.s_kv, a.d_v)  # orthonormal V rows: the keep-mask is read back from O
            if a.s_q > a.s_kv and not padded:
                a.window = None
            if padded:
                a.lkv = [min(n, a.s_kv) for n in a.lkv]
            if a.bias_shape:
                a.bias_shape = a.bias_shape[:3] + (a.s_kv,)
    if rng.random() < 0.3:
        a.scale = rng.choice([0.05, 0.3, 1.0, -0.5, 0.0, 2.0])
        a.scale_form = rng.choice(["float", "float", "int"]) if float(a.scale).is_integer() else "float"
    if backward and a.s_q == 1 and a.s_kv == 1:
        a.s_kv = 2
        if a.bias_shape:
            a.bias_shape = a.bias_shape[:3] + (2,)
        if a.lkv:
            a.lkv = [min(n, 2) for n in a.lkv]
    make_tensors(a, rng, gen)
    return a


def make_tensors(a: Attn, rng: random.Random, gen: torch.Generator) -> None:
    t = a.tensors
    if (
        not a.p
        and a.h_q == a.h_kv
        and a.s_q == a.s_kv
        and a.d_qk == a.d_v
        and rng.random() < 0.08
        and not a.nan_beyond_len
    ):
        a.packed_qkv = True
        qkv = randn(gen, a.b, a.s_q, 3, a.h_q, a.d_qk, dtype=a.dtype)
        t["q"], t["k"], t["v"] = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        a.layouts = ("BS3HD",) * 3
    else:
        q = randn(gen, a.b, a.h_q, a.s_q, a.d_qk, dtype=a.dtype)
        k = randn(gen, a.b, a.h_kv, a.s_kv, a.d_qk, dtype=a.dtype)
        if a.p:
            v = orthonormal_rows(gen, a.b, a.h_kv, a.s_kv, a.d_v, a.dtype)
        else:
            v = randn(gen, a.b, a.h_kv, a.s_kv, a.d_v, dtype=a.dtype)
        t["clean"] = (q, k, v)  # what the oracle sees
        if a.nan_beyond_len:  # garbage past the lengths must not reach the result
            # Large finite values (100x), not NaN: cuDNN reads whole tiles and 0 * NaN is NaN, as in torch's
            # SDPA under a mask (docs/semantics.md: positions past the lengths hold finite values).
            q, k, v = q.clone(), k.clone(), v.clone()
            for bi in range(a.b):
                for x, length in ((q, a.lq[bi]), (k, a.lkv[bi]), (v, a.lkv[bi])):
                    x[bi, :, length:] = 100 * torch.randn(x[bi, :, length:].shape, generator=gen).sign().to(x.dtype)
        t["q"], t["k"], t["v"] = (to_layout(x, lay) for x, lay in zip((q, k, v), a.layouts))
    t.setdefault("clean", (t["q"], t["k"], t["v"]))
    if a.bias_shape is not None:
        t["bias"] = randn(gen, *a.bias_shape, dtype=a.bias_dtype)
    if a.lq is not None:
        shape = (a.b,) if a.len_shape == "B" else (a.b, 1, 1, 1)
        t["seq_len_q"] = _int32(a.lq).view(shape)
        t["seq_len_kv"] = _int32(a.lkv).view(shape)
    if a.p and a.rng_form != "int":
        t["seed"] = torch.tensor([a.drop_seed], dtype=torch.int64)
        t["offset"] = torch.tensor([a.drop_offset], dtype=rng.choice([torch.int64, torch.int32]))
        if rng.random() < 0.3:
            t["seed"] = t["seed"].view(1, 1, 1, 1)


def sdpa_keywords(a: Attn) -> dict:
    t, kw = a.tensors, {}
    if a.scale is not None:
        kw["attn_scale"] = int(a.scale) if a.scale_form == "int" else a.scale
    if a.causal == "top_left":
        kw["use_causal_mask"] = True
    elif a.causal == "bottom_right":
        kw["use_causal_mask_bottom_right"] = True
    if a.window is not None:
        kw["sliding_window_length"] = a.window
    if a.alibi:
        kw["use_alibi_mask"] = True
    if "bias" in t:
        kw["attn_bias"] = t["bias"]
    if a.lq is not None:
        kw.update(use_padding_mask=True, seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"])
    if a.p:
        if a.rng_form == "int":
            kw.update(dropout=a.p, dropout_seed=a.drop_seed, dropout_offset=a.drop_offset)
        elif a.rng_form == "tensor":
            kw.update(dropout=a.p, dropout_seed=t["seed"], dropout_offset=t["offset"])
        else:
            kw["dropout"] = (a.p, t["seed"], t["offset"])
    return kw


def distinct(tensors: list) -> list:
    seen, out = set(), []
    for x in tensors:
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
    return out


def forward_run_inputs(a: Attn) -> list:
    """The positional inputs of a one-node sdpa graph (API section 2: q, k, v, attn_bias, seq_len_q,
    seq_len_kv, dropout seed, dropout offset), distinct tensors in order of first use."""
    t = a.tensors
    return distinct(
        [t["q"], t["k"], t["v"], t.get("bias"), t.get("seq_len_q"), t.get("seq_len_kv"), t.get("seed"), t.get("offset")]
    )


def expected_forward(a: Attn, o_actual: torch.Tensor | None = None):
    """Oracle (O, LSE, empty-row mask, keep) for ``a``; with dropout the keep-mask is read from O."""
    q, k, v = a.tensors["clean"]
    allowed = a.allowed()
    bias = a.bias64()
    keep = None
    if a.p:
        probs = probs64(q, k, scale=a.scale_value, allowed=allowed, bias=bias)
        assert not torch.isnan(as_tensor(o_actual)).any(), "O: NaN in result"
        keep, _ = infer_keep(as_tensor(o_actual).detach(), v, probs, a.p)
        check_dropout_rate(keep, probs, a.p)
        check_documented_keep(keep, probs, a.drop_seed, a.drop_offset, a.p)
    o, lse = oracle.attention(
        q,
        k,
        v,
        scale=a.scale_value,
        causal=a.causal,
        window=a.window,
        seq_q=a.lq,
        seq_kv=a.lkv,
        bias=a.tensors.get("bias"),
        alibi=a.alibi,
        keep=keep,
        p=a.p,
    )
    return o, lse, empty_rows(allowed, o.shape), keep


# ---- mutations shared by the graph ops -----------------------------------------------------------------

# Mutations that issue 42 made well formed: a head dim off the multiples of 8 or past 256, and an
# empty batch or sequence in a dense request (torch's SDPA takes both). The reference backend runs
# them (VALID on the CPU: they must match the oracle); cuDNN refuses some with an UnsupportedError
# naming why (EITHER on the GPU: that refusal, ``resized_refusal``, or a correct result).
RESIZED = ("headdim-12", "headdim-260", "b-0", "sq-0", "skv-0")


def _resized_expectation() -> str:
    return EITHER if on_cuda() else VALID


def resized_refusal(label: str, a: Attn, kw: dict) -> tuple[tuple, tuple]:
    """(errors, names): the refusals a ``RESIZED`` request may get where it is EITHER."""
    if label.startswith("headdim-"):
        # cuDNN's rules name the head dim; past 256 on Hopper its own planning may decline ("could not build a plan")
        return (cudnn_attn.UnsupportedError,), ("q", "k", "v", "d_qk", "d_v", "head_dim", "plan")
    names = ("q", "k", "v", "B", "S_q", "S_kv")
    if label == "b-0" and "seq_len_q" in kw:  # lengths of shape [0]: refused by validation on every backend
        return REQUEST_ERRORS, names + ("seq_len_q", "seq_len_kv")
    if label == "skv-0" and a.causal == "bottom_right" and "seq_len_q" not in kw:
        return (cudnn_attn.UnsupportedError,), names + ("use_causal_mask_bottom_right",)
    return (cudnn_attn.UnsupportedError,), names


def resized_expected(a: Attn, kw: dict, q, k, v):
    """(O, LSE, empty rows) in float64 for a ``RESIZED`` request's own q, k, v under ``a``'s options (the
    default scale from its own head dim). An empty batch or sequence gives an empty O, or zeros with
    LSE -inf for S_kv = 0, as torch's SDPA does."""
    b, h, s_q, s_kv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if 0 in (b, s_q, s_kv):
        o = torch.zeros(b, h, s_q, v.shape[-1], dtype=torch.float64)
        lse = torch.full((b, h, s_q, 1), float("-inf"), dtype=torch.float64)
        return o, lse, torch.ones(b, 1, s_q, 1, dtype=torch.bool)
    lq, lkv = (a.lq, a.lkv) if "seq_len_q" in kw else (None, None)
    scale = a.scale if a.scale is not None else 1 / math.sqrt(q.shape[-1])
    o, lse = oracle.attention(
        q,
        k,
        v,
        scale=scale,
        causal=a.causal,
        window=a.window,
        seq_q=lq,
        seq_kv=lkv,
        bias=kw.get("attn_bias"),
        alibi=a.alibi,
    )
    allowed = scores_mask(b, h, s_q, s_kv, causal=a.causal, window=a.window, lq=lq, lkv=lkv)
    return o, lse, empty_rows(allowed, o.shape)


def resized_forward_check(a: Attn, kw: dict, roles: dict, stats: bool) -> Callable[[Any], None]:
    def check(result):
        results = unpack_outputs(result, 2 if stats else 1)
        o_exp, lse, empty = resized_expected(a, kw, roles["q"], roles["k"], roles["v"])
        assert_close("O", results[0], o_exp, tol(a.dtype), a.dtype, empty)
        if stats:
            assert_close("Stats", results[1], lse, REFERENCE_TOL, torch.float32)

    return check


def resized_backward_check(a: Attn, kw: dict, roles: dict) -> Callable[[Any], None]:
    """Gradients of a ``RESIZED`` backward (its O and stats made by ``resized_expected``): zeros where
    a dimension is empty, else the float64 formula given the O passed."""
    q, k, v, o, d_o = (roles[r] for r in ("q", "k", "v", "o", "dO"))

    def check(result):
        results = unpack_outputs(result, 3)
        b, h, s_q, s_kv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if 0 in (b, s_q, s_kv):
            for name, actual, x in zip(("dQ", "dK", "dV"), results, (q, k, v)):
                assert_close(name, actual, torch.zeros(x.shape, dtype=torch.float64), tol(a.dtype), a.dtype)
            return
        lq, lkv = (a.lq, a.lkv) if "seq_len_q" in kw else (None, None)
        allowed = scores_mask(b, h, s_q, s_kv, causal=a.causal, window=a.window, lq=lq, lkv=lkv)
        bias = kw["attn_bias"].double().expand(b, h, s_q, s_kv) if "attn_bias" in kw else None
        if a.alibi:
            bias = alibi_bias64(h, s_q, s_kv) + (0 if bias is None else bias)
        a2 = Attn(a.dtype, b, h, k.shape[1], s_q, s_kv, q.shape[-1], v.shape[-1], scale=a.scale)
        _check_grads(results, a2, q, k, v, o, d_o, allowed, bias, None)

    return check


def dropout_tuple_tensors(kw: dict) -> list:
    """The seed and offset tensors of ``dropout=(p, seed, offset)``: run inputs, as dropout_seed/offset are."""
    dropout = kw.get("dropout")
    return [x for x in dropout[1:] if isinstance(x, torch.Tensor)] if isinstance(dropout, tuple) else []


def mutate_request(rng: random.Random, gen: torch.Generator, a: Attn, kw: dict, roles: dict, backward=False):
    """Make a valid graph request malformed in one way: returns (label, expect) and edits roles/kw in place."""
    t = a.tensors
    dt, other = a.dtype, (torch.bfloat16 if a.dtype == torch.float16 else torch.float16)
    B, H, SQ, SK, D = a.b, a.h_q, a.s_q, a.s_kv, a.d_qk  # noqa: N806
    choices = [
        "q-rank2",
        "q-rank5",
        "k-rank3",
        "q-0d",
        "seq-len-0d",
        "q-nontensor",
        "k-nontensor",
        "v-nontensor",
        "q-float32",
        "q-float64",
        "q-int32",
        "q-bool",
        "q-complex",
        "k-dtype",
        "v-dtype",
        "k-batch",
        "v-seq",
        "k-headdim",
        "kv-heads",
        "headdim-12",
        "headdim-0",
        "headdim-260",
        "b-0",
        "sq-0",
        "skv-0",
        "h-0",
        "q-last-stride",
        "k-last-stride0",
        "k-meta",
        "v-meta",
        "q-meta-only",
        "bias-rank3",
        "bias-heads3",
        "bias-sq",
        "bias-skv-1",
        "bias-int64",
        "bias-float64",
        "bias-nontensor",
        "bias-meta",
        "bias-alias-twice",
        "both-causal",
        "window-0",
        "window-neg",
        "window-float",
        "window-bool",
        "causal-str",
        "alibi-str",
        "padding-no-lengths",
        "lengths-no-padding",
        "seq-len-int16",
        "seq-len-float",
        "seq-len-shape",
        "seq-len-too-big",
        "seq-len-negative",
        "seq-len-list",
        "seq-len-meta",
        "dropout-bad",
        "dropout-tuple2",
        "dropout-tuple-and-seed",
        "dropout-seed-shape",
        "dropout-seed-float",
        "dropout-seed-bool",
        "dropout-seed-floatval",
        "dropout-seed-str",
        "scale-bad",
        "stats-contradiction",
        "stats-flag-str",
        "io-dtype",
        "io-dtype-garbage",
        "backend-garbage",
        "backend-cudnn-on-cpu",
        "paged-max-without-tables",
    ]
    if backward:
        choices += [
            "dO-None",
            "o-None",
            "stats-None",
            "stats-fp16",
            "stats-rank3",
            "stats-rows",
            "dO-shape",
            "dO-dtype",
            "o-dtype",
            "o-headdim",
            "q-fp8",
            "stats-meta",
            "dO-nontensor",
        ]
        drop = ("stats-contradiction", "stats-flag-str", "paged-max-without-tables")  # not sdpa_backward keywords
        choices = [c for c in choices if c not in drop]
    m = rng.choice(choices)
    expect = MALFORMED

    def fresh(*shape, dtype=dt):
        return randn(gen, *shape, dtype=dtype)

    if m == "q-rank2":
        roles["q"] = fresh(SQ, D)
    elif m == "q-rank5":
        roles["q"] = fresh(1, B, H, SQ, D)
    elif m == "k-rank3":
        roles["k"] = fresh(a.h_kv, SK, D)
    elif m == "q-0d":
        roles["q"] = torch.tensor(1.0, dtype=dt)
    elif m == "seq-len-0d":
        kw.update(use_padding_mask=True, seq_len_q=torch.tensor(SQ, dtype=torch.int32), seq_len_kv=_int32([SK] * B))
    elif m in ("q-nontensor", "k-nontensor", "v-nontensor", "dO-nontensor"):
        name, value = pick(rng, NON_TENSORS)
        roles[m.split("-")[0]] = value
        m = f"{m}={name}"
    elif m in ("q-float32", "q-float64", "q-int32", "q-bool", "q-complex"):
        dtype = {
            "q-float32": torch.float32,
            "q-float64": torch.float64,
            "q-int32": torch.int32,
            "q-bool": torch.bool,
            "q-complex": torch.complex64,
        }[m]
        roles["q"] = t["q"].to(dtype)
        if rng.random() < 0.5 and dtype.is_floating_point:  # all three in that dtype
            roles["k"], roles["v"] = t["k"].to(dtype), t["v"].to(dtype)
            m += "-qkv"
            if dtype == torch.float32 and not backward:  # torch's SDPA takes float32: run, or refused (issue 18)
                expect = EITHER
    elif m in ("k-dtype", "v-dtype"):
        roles[m[0]] = t[m[0]].to(other)
    elif m == "k-batch":
        roles["k"], roles["v"] = fresh(B + 1, a.h_kv, SK, D), fresh(B + 1, a.h_kv, SK, a.d_v)
    elif m == "v-seq":
        roles["v"] = fresh(B, a.h_kv, SK + 1, a.d_v)
    elif m == "k-headdim":
        roles["k"] = fresh(B, a.h_kv, SK, 24 - D)
    elif m == "kv-heads":
        hk = 2 if H == 3 else 3
        roles["k"], roles["v"] = fresh(B, hk, SK, D), fresh(B, hk, SK, a.d_v)
    elif m in ("headdim-12", "headdim-0", "headdim-260"):
        d = {"headdim-12": 12, "headdim-0": 0, "headdim-260": 260}[m]
        roles["q"], roles["k"], roles["v"] = fresh(B, H, SQ, d), fresh(B, a.h_kv, SK, d), fresh(B, a.h_kv, SK, d)
        if backward:
            roles["o"], roles["dO"] = fresh(B, H, SQ, d), fresh(B, H, SQ, d)
        if d:  # any head dim >= 1 is well formed (issue 42): the reference runs it, cuDNN refuses some by name
            expect = _resized_expectation()
            for key in ("dropout", "dropout_seed", "dropout_offset"):  # V is not orthonormal: no keep-mask to read
                kw.pop(key, None)
    elif m in ("b-0", "sq-0", "skv-0", "h-0"):
        b0 = 0 if m == "b-0" else B
        sq0, sk0 = (0 if m == "sq-0" else SQ), (0 if m == "skv-0" else SK)
        h0, hk0 = (0, 0) if m == "h-0" else (H, a.h_kv)
        roles["q"], roles["k"], roles["v"] = fresh(b0, h0, sq0, D), fresh(b0, hk0, sk0, D), fresh(b0, hk0, sk0, a.d_v)
        kw.pop("attn_bias", None)
        if "seq_len_q" in kw:
            kw.update(seq_len_q=_int32([0] * b0), seq_len_kv=_int32([0] * b0))
        if backward:
            roles["o"], roles["dO"] = fresh(b0, h0, sq0, a.d_v), fresh(b0, h0, sq0, a.d_v)
            roles["stats"] = torch.randn(b0, h0, sq0, 1, generator=gen)
        if m != "h-0":  # B, S_q or S_kv = 0 is torch's empty call (issue 42); heads stay >= 1
            expect = _resized_expectation()
            if m == "b-0" and "seq_len_q" in kw:
                expect = EITHER  # lengths of shape [0]: the graphs take empty dims in dense q/k/v/bias only
            if m == "skv-0" and a.causal == "bottom_right" and "seq_len_q" not in kw:
                expect = EITHER  # S_q > S_kv = 0 under a bottom-right mask, as sdpa/either/br-sq-gt-skv
    elif m == "q-last-stride":
        roles["q"] = fresh(B, H, D, max(SQ, 2)).transpose(-1, -2)
        if SQ == 1:
            roles["q"] = roles["q"][:, :, :1]
    elif m == "k-last-stride0":
        roles["k"] = fresh(B, a.h_kv, SK, 1).expand(B, a.h_kv, SK, D)
    elif m in ("k-meta", "v-meta"):
        roles[m[0]] = t[m[0]].to("meta")
    elif m == "q-meta-only":
        roles["q"] = t["q"].to("meta")
    elif m.startswith("bias-"):
        kw.pop("bias", None)
        if m == "bias-rank3":
            kw["attn_bias"] = fresh(H, SQ, SK)
        elif m == "bias-heads3":
            kw["attn_bias"] = fresh(1, 2 if H == 3 else 3, SQ, SK)
        elif m == "bias-sq":
            kw["attn_bias"] = fresh(1, 1, SQ + 1, SK)
        elif m == "bias-skv-1":
            kw["attn_bias"] = fresh(1, 1, SQ, 1)
            if SK == 1:
                kw["attn_bias"] = fresh(1, 1, SQ, 3)
            else:
                expect = EITHER  # keys broadcast: cuDNN does not take it; a correct result is fine too
        elif m == "bias-int64":
            kw["attn_bias"] = torch.randint(-3, 3, (1, 1, SQ, SK), generator=gen)
        elif m == "bias-float64":
            kw["attn_bias"] = fresh(1, 1, SQ, SK, dtype=torch.float64)
        elif m == "bias-nontensor":
            name, value = pick(rng, NON_TENSORS[1:])
            kw["attn_bias"] = value
            m = f"bias-nontensor={name}"
        elif m == "bias-meta":
            kw["attn_bias"] = fresh(1, 1, SQ, SK).to("meta")
        elif m == "bias-alias-twice":
            kw["attn_bias"], kw["bias"] = fresh(1, 1, SQ, SK), fresh(1, 1, SQ, SK)
        if a.causal == "bottom_right":
            kw.pop("use_causal_mask_bottom_right", None)
    elif m == "both-causal":
        kw.update(use_causal_mask=True, use_causal_mask_bottom_right=True)
    elif m in ("window-0", "window-neg", "window-float", "window-bool"):
        kw["sliding_window_length"] = {"window-0": 0, "window-neg": -2, "window-float": 2.5, "window-bool": True}[m]
    elif m == "causal-str":
        kw.pop("use_causal_mask_bottom_right", None)
        kw["use_causal_mask"] = "yes"
    elif m == "alibi-str":
        kw["use_alibi_mask"] = "yes"
    elif m == "padding-no-lengths":
        kw.pop("seq_len_q", None), kw.pop("seq_len_kv", None)
        kw["use_padding_mask"] = True
    elif m == "lengths-no-padding":
        kw.update(use_padding_mask=False, seq_len_q=_int32([SQ] * B), seq_len_kv=_int32([SK] * B))
    elif m.startswith("seq-len-"):
        kw["use_padding_mask"] = True
        lq, lk = _int32([SQ] * B), _int32([SK] * B)
        if m == "seq-len-int16":
            lq = lq.to(torch.int16)
        elif m == "seq-len-float":
            lk = lk.float()
        elif m == "seq-len-shape":
            lq = _int32([SQ] * (B + 1))
        elif m == "seq-len-too-big":
            lk = _int32([SK + rng.choice([1, 7, 2**31 - 1 - SK])] + [SK] * (B - 1))
        elif m == "seq-len-negative":
            lq = _int32([-1] + [SQ] * (B - 1))
        elif m == "seq-len-list":
            lq = [SQ] * B
        elif m == "seq-len-meta":
            lk = lk.to("meta")
        kw.update(seq_len_q=lq, seq_len_kv=lk)
    elif m.startswith("dropout-"):
        for key in ("dropout", "dropout_seed", "dropout_offset"):
            kw.pop(key, None)
        kw.pop("use_causal_mask_bottom_right", None)
        if m == "dropout-bad":
            name, value = pick(rng, BAD_PROBS)
            kw["dropout"] = value
            m = f"dropout={name}"
        elif m == "dropout-tuple2":
            kw["dropout"] = (0.1, torch.tensor([1]))
        elif m == "dropout-tuple-and-seed":
            kw.update(dropout=(0.1, torch.tensor([1]), torch.tensor([0])), dropout_seed=3)
        elif m == "dropout-seed-shape":
            kw.update(dropout=0.1, dropout_seed=torch.tensor([1, 2]))
        elif m == "dropout-seed-float":
            kw.update(dropout=0.1, dropout_seed=torch.tensor([1.0]))
        elif m == "dropout-seed-bool":
            kw.update(dropout=0.1, dropout_seed=True)
        elif m == "dropout-seed-floatval":
            kw.update(dropout=0.1, dropout_seed=1.5)
        elif m == "dropout-seed-str":
            kw.update(dropout=0.1, dropout_offset="0")
    elif m == "scale-bad":
        name, value = pick(rng, BAD_SCALES)
        kw["attn_scale"] = value
        m = f"attn_scale={name}"
    elif m == "stats-contradiction":
        kw.update(is_inference=True, generate_stats=True)
    elif m == "stats-flag-str":
        kw["generate_stats"] = "no"
    elif m in ("io-dtype", "io-dtype-garbage", "backend-garbage", "backend-cudnn-on-cpu"):
        roles["__graph__"] = {
            "io-dtype": {"io_data_type": other},
            "io-dtype-garbage": {"io_data_type": "complex"},
            "backend-garbage": {"backend": "tensorrt"},
            "backend-cudnn-on-cpu": {"backend": "cudnn"},
        }[m]
    elif m == "paged-max-without-tables":
        kw["paged_attention_max_seq_len_kv"] = SK
    elif m == "dO-None":
        roles["dO"] = None
    elif m == "o-None":
        roles["o"] = None
    elif m == "stats-None":
        roles["stats"] = None
    elif m == "stats-fp16":
        roles["stats"] = roles["stats"].half()
    elif m == "stats-rank3":
        roles["stats"] = roles["stats"][..., 0]
    elif m == "stats-rows":
        roles["stats"] = torch.randn(B, H, SQ + 1, 1, generator=gen)
    elif m == "stats-meta":
        roles["stats"] = roles["stats"].to("meta")
    elif m == "dO-shape":
        roles["dO"] = fresh(B, H, SQ + 1, a.d_v)
    elif m == "dO-dtype":
        roles["dO"] = roles["dO"].to(other)
    elif m == "o-dtype":
        roles["o"] = roles["o"].to(other)
    elif m == "o-headdim":
        roles["o"] = fresh(B, H, SQ, 24 - a.d_v)
    elif m == "q-fp8":
        roles["q"], roles["k"], roles["v"] = (t[r].to(torch.float8_e4m3fn) for r in "qkv")
        roles["o"], roles["dO"] = (roles[r].to(torch.float8_e4m3fn) for r in ("o", "dO"))
    return m, expect


def runtime_mutation(
    rng: random.Random, gen: torch.Generator, inputs: list, outs_spec: list | None, lengths=None, no_swap=()
):
    """A wrong run of a well-built graph: returns (label, args, kwargs) for g(*args, **kwargs)."""
    args = list(inputs)
    floats = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    choices = ["missing", "extra", "nontensor", "0d", "shape", "dtype", "meta", "strides", "numpy-dtype", "swap"]
    if outs_spec:
        choices += ["out-shape", "out-dtype", "out-stride", "out-count", "out-nontensor", "out-meta"]
    if lengths:
        choices += ["lengths-range"]
    m = rng.choice(choices)
    i = rng.randrange(len(args))
    kwargs = {}
    if m == "missing":
        args.pop(rng.randrange(len(args)))
    elif m == "extra":
        args.append(args[0])
    elif m == "nontensor":
        name, value = pick(rng, NON_TENSORS)
        args[i] = value
        m = f"nontensor={name}"
    elif m == "0d":
        args[i] = torch.tensor(1, dtype=args[i].dtype)
    elif m == "shape":
        x = args[i]
        shape = list(x.shape)
        shape[rng.randrange(len(shape))] += 1
        args[i] = (
            (torch.randn(*shape, generator=gen) * 3).to(x.dtype)
            if x.is_floating_point()
            else torch.ones(shape, dtype=x.dtype)
        )
    elif m == "dtype":
        x = args[i]
        swap = {
            torch.float16: torch.bfloat16,
            torch.bfloat16: torch.float16,
            torch.float32: torch.float16,
            torch.int32: torch.int64,
            torch.int64: torch.float32,
        }
        args[i] = x.to(swap.get(x.dtype, torch.float64))
    elif m == "meta":
        args[i] = args[i].to("meta")
    elif m == "strides":
        candidates = [j for j in floats if args[j].dim() >= 3 and sum(n > 1 for n in args[j].shape[:-1]) >= 2]
        if not candidates:
            return runtime_mutation(rng, gen, inputs, outs_spec, lengths, no_swap)
        j = rng.choice(candidates)
        x = args[j]
        for layout in ("BSHD", "SBHD", "HBSD", "BHSD"):
            y = to_layout(x, layout)
            if not same_memory_order(y, x.stride(), x.shape):
                args[j] = y
                break
        else:
            return runtime_mutation(rng, gen, inputs, outs_spec, lengths, no_swap)
    elif m == "numpy-dtype":  # a float32 array where the graph has another dtype
        others = [j for j in floats if args[j].dtype != torch.float32]
        if not others:
            return runtime_mutation(rng, gen, inputs, outs_spec, lengths, no_swap)
        j = rng.choice(others)
        args[j] = args[j].float().numpy()
    elif m == "swap":
        pairs = [
            (x, y)
            for x in range(len(args))
            for y in range(x + 1, len(args))
            if _geometry(args[x]) != _geometry(args[y]) and {x, y} not in no_swap
        ]
        if not pairs:
            return runtime_mutation(rng, gen, inputs, outs_spec, lengths, no_swap)
        x, y = rng.choice(pairs)
        args[x], args[y] = args[y], args[x]
    elif m.startswith("out-"):
        outs = [poisoned(s, st, d) for s, st, d in outs_spec]
        j = rng.randrange(len(outs))
        s, st, d = outs_spec[j]
        if m == "out-shape":
            shape = list(s)
            shape[rng.randrange(len(shape))] += 1
            outs[j] = poisoned(shape, contiguous_stride(shape), d)
        elif m == "out-dtype":
            outs[j] = poisoned(s, st, torch.float64 if d == torch.float32 else torch.float32)
        elif m == "out-stride":
            alt = contiguous_stride(s)
            if all(n == 1 or x == y for n, x, y in zip(s, alt, st)):
                alt = strides_like(s, tuple(reversed(range(len(s)))))  # reversed order
                if all(n == 1 or x == y for n, x, y in zip(s, alt, st)):
                    return runtime_mutation(rng, gen, inputs, None, lengths, no_swap)
            outs[j] = poisoned(s, alt, d)
        elif m == "out-count":
            outs = outs[:-1] if len(outs) > 1 else outs + outs
        elif m == "out-nontensor":
            outs[j] = "out"
        elif m == "out-meta":
            outs[j] = outs[j].to("meta")
        kwargs["out"] = outs[0] if len(outs) == 1 and m != "out-count" else tuple(outs)
        if m == "out-count" and len(outs) == 1:
            kwargs["out"] = tuple(outs)
    elif m == "lengths-range":
        j, limit = rng.choice(lengths)
        bad = args[j].clone()
        bad.view(-1)[rng.randrange(bad.numel())] = rng.choice([-1, limit + 1, 2**31 - 1])
        args[j] = bad
    return "run:" + m, args, kwargs


def _geometry(x):
    if not isinstance(x, torch.Tensor):
        return None
    return (tuple(x.shape), x.dtype, tuple(s for s, n in zip(x.stride(), x.shape) if n > 1))


def _graph(kwargs: dict | None = None, rng: random.Random | None = None, **extra) -> Any:
    """A new ``Graph`` (30% of the time with a private plan cache); through the running case's
    boundary, when it has one."""
    kw = dict(extra)
    if kwargs:
        kw.update(kwargs)
    if rng is not None and "cache" not in kw and rng.random() < 0.3:
        kw["cache"] = cudnn_attn.PlanCache()
    graph = cudnn_attn.Graph(**kw)
    return graph if _boundary is None else _GraphAtTheDoor(graph, _boundary)


# ---- op: Graph.sdpa (dense) --------------------------------------------------------------------------


def _sdpa_case(rng: random.Random, gen: torch.Generator) -> Case:
    a = draw_attn(rng, gen)
    r = rng.random()
    if r < 0.5:
        return _sdpa_valid(rng, gen, a)
    if r < 0.56:
        return _sdpa_either(rng, gen, a)
    if r < 0.62:
        return _sdpa_misuse(rng, gen, a)
    if r < 0.78:
        return _sdpa_runtime_malformed(rng, gen, a)
    return _sdpa_build_malformed(rng, gen, a)


def _stats_flags(rng: random.Random) -> tuple[dict, bool | None]:
    form = rng.choice(["gen", "inf", "both", "none", "gen-false"])
    return {
        "gen": ({"generate_stats": True}, True),
        "inf": ({"is_inference": False}, True),
        "both": ({"is_inference": False, "generate_stats": True}, True),
        "none": ({}, None),
        "gen-false": ({"generate_stats": False}, False),
    }[form]


def _output_geometry(rng: random.Random, a: Attn, q_like: torch.Tensor):
    """(shape, stride) chosen for O: q's layout, contiguous BHSD, or BSHD."""
    shape = (*q_like.shape[:-1], a.d_v)
    form = rng.choice(["q", "bhsd", "bshd"])
    if form == "bhsd" or q_like.dim() != 4:
        return shape, contiguous_stride(shape)
    if form == "bshd":
        return shape, strides_like(shape, (4, 2, 3, 1))
    return shape, strides_like(shape, q_like.stride())


def _sdpa_valid(rng, gen, a: Attn) -> Case:
    kw = sdpa_keywords(a)
    flags, want_stats = _stats_flags(rng)
    kw.update(flags)
    if "attn_bias" in kw and rng.random() < 0.3:
        kw["bias"] = kw.pop("attn_bias")
    use_out = rng.random() < 0.4
    set_geometry = use_out or rng.random() < 0.2
    o_geom = _output_geometry(rng, a, a.tensors["q"])
    stats_geom = ((a.b, a.h_q, a.s_q, 1), contiguous_stride((a.b, a.h_q, a.s_q, 1)))
    o2_geom = ((a.b, a.h_q, a.s_q, a.d_v), contiguous_stride((a.b, a.h_q, a.s_q, a.d_v)))
    two_nodes = rng.random() < 0.06 and not a.nan_beyond_len  # node 2 has no lengths: garbage would count
    graph_kw = {}
    if rng.random() < 0.2:
        graph_kw["io_data_type"] = rng.choice([a.dtype, cudnn_attn.data_type.from_torch(a.dtype)])
    if rng.random() < 0.5:
        graph_kw["backend"] = own_backend()
    use_handle = rng.random() < 0.1
    as_numpy = (
        a.dtype == torch.float16 and rng.random() < 0.06 and not gpu_like()
    )  # DLPack arrays in, the same kind out
    as_dict = rng.random() < 0.06
    inputs = forward_run_inputs(a)
    decoy = _decoy_keywords(rng, a, kw) if rng.random() < 0.25 else None
    if decoy is not None:  # the plan cache's signature must tell the two graphs apart
        graph_kw["cache"] = cudnn_attn.PlanCache()
    extra_kv = None
    if two_nodes:
        extra_kv = (
            randn(gen, a.b, a.h_kv, a.s_kv, a.d_qk, dtype=a.dtype),
            randn(gen, a.b, a.h_kv, a.s_kv, a.d_v, dtype=a.dtype),
        )
    shown = {x: ("PlanCache()" if x == "cache" else y) for x, y in graph_kw.items()}
    desc = f"g.sdpa({a.describe()}) flags={flags} graph={shown} out={use_out} set_dim/stride={set_geometry} two_nodes={two_nodes} numpy={as_numpy} dict={as_dict} after_decoy={decoy and decoy[0]}"
    state: dict = {}

    def call(case):
        t = a.tensors
        if decoy is not None:  # the same tensors, one option changed, built first into the same cache
            with _graph(graph_kw) as g0:
                g0.sdpa(t["q"], t["k"], t["v"], **decoy[1])
            g0(
                *distinct(
                    [
                        t["q"],
                        t["k"],
                        t["v"],
                        decoy[1].get("attn_bias"),
                        decoy[1].get("bias"),
                        t.get("seq_len_q"),
                        t.get("seq_len_kv"),
                        t.get("seed"),
                        t.get("offset"),
                    ]
                )
            )
        with _graph(graph_kw, rng) as g:
            o, stats = g.sdpa(t["q"], t["k"], t["v"], **kw)
            if set_geometry:
                o.set_output(True).set_dim(o_geom[0]).set_stride(o_geom[1])
                if stats is not None:
                    stats.set_output(True).set_dim(stats_geom[0]).set_stride(stats_geom[1])
            handles = [("O", o)] + ([("Stats", stats)] if stats is not None else [])
            if two_nodes:
                o2, s2 = g.sdpa(t["q"], extra_kv[0], extra_kv[1], attn_scale=0.25, generate_stats=True)
                o2.set_dim(o2_geom[0]).set_stride(o2_geom[1])
                s2.set_dim(stats_geom[0]).set_stride(stats_geom[1])
                handles += [("O2", o2), ("Stats2", s2)]
        if want_stats is not None:
            assert (stats is not None) == want_stats, f"stats handle {stats!r} with flags {flags}"
        state["kinds"] = [name for name, _ in handles]
        args = inputs + (list(extra_kv) if two_nodes else [])
        run_kw = {}
        outs = None
        if use_out:
            outs = [poisoned(*o_geom, a.dtype)] + ([poisoned(*stats_geom, torch.float32)] if stats is not None else [])
            if two_nodes:  # every output, in node order
                outs += [poisoned(*o2_geom, a.dtype), poisoned(*stats_geom, torch.float32)]
            run_kw["out"] = outs[0] if len(outs) == 1 else tuple(outs)
        state["outs"] = outs
        if use_handle:
            run_kw["handle"] = cudnn_attn.create_handle()
        if as_numpy:
            args = [x.numpy() for x in args]
        if as_dict:
            return g({h.name: x for h, x in zip(g.inputs, args)}, **run_kw)
        return g(*args, **run_kw)

    def check(result):
        kinds = state["kinds"]
        results = dict(zip(kinds, unpack_outputs(result, len(kinds))))
        if as_numpy:
            assert all(isinstance(r, np.ndarray) for r in results.values()), "numpy inputs must give numpy outputs"
        o_exp, lse, empty, _ = expected_forward(a, results["O"])
        assert_close("O", results["O"], o_exp, tol(a.dtype), a.dtype, empty)
        if set_geometry:
            assert as_tensor(results["O"]).stride() == tuple(o_geom[1]), "O ignores set_stride"
        if "Stats" in results:
            assert_close("Stats", results["Stats"], lse, REFERENCE_TOL, torch.float32)
        if two_nodes:
            q, _, _ = a.tensors["clean"]
            o2, lse2 = oracle.attention(q, extra_kv[0], extra_kv[1], scale=0.25)
            assert_close("O (node 2)", results["O2"], o2, tol(a.dtype), a.dtype)
            assert_close("Stats (node 2)", results["Stats2"], lse2, REFERENCE_TOL, torch.float32)
        check_out_buffers(list(results.values()), state["outs"])

    return _new_case(VALID, "sdpa/valid/" + _features(a), desc, call, check)


def _decoy_keywords(rng: random.Random, a: Attn, kw: dict):
    """(what changed, keywords): a valid neighbour of ``kw`` differing in one plan-changing option."""
    options = ["scale", "stats"]
    if a.causal is None and not a.alibi and (a.window is None or a.s_q <= a.s_kv or a.lq is not None):
        options.append("causal")
    if a.causal == "top_left" and not a.alibi:
        options.append("no-causal")
    if a.window is not None:
        options.append("window")
    if a.p:
        options.append("dropout")
    if a.bias_shape is not None:
        options.append("no-bias")
    what = rng.choice(options)
    new = dict(kw)
    if what == "scale":
        new["attn_scale"] = a.scale_value * 0.5 + 0.3  # never a.scale_value itself
    elif what == "stats":
        stats = kw.get("generate_stats", not kw["is_inference"] if kw.get("is_inference") is not None else False)
        new.pop("is_inference", None)
        new["generate_stats"] = not stats
    elif what == "causal":
        new["use_causal_mask"] = True
    elif what == "no-causal":
        new.pop("use_causal_mask")
    elif what == "window":
        new["sliding_window_length"] = a.window + 1
    elif what == "dropout":
        new["dropout"] = (a.p + 0.2, *kw["dropout"][1:]) if isinstance(kw["dropout"], tuple) else a.p + 0.2
    elif what == "no-bias":
        new.pop("attn_bias", None), new.pop("bias", None)
    return what, new


def _features(a: Attn) -> str:
    parts = []
    if a.causal:
        parts.append(a.causal)
    if a.window is not None:
        parts.append("window")
    if a.alibi:
        parts.append("alibi")
    if a.bias_shape:
        parts.append("bias")
    if a.lq is not None:
        parts.append("padding")
    if a.p:
        parts.append("dropout")
    if a.nan_beyond_len:
        parts.append("nan-beyond-len")
    if a.h_kv != a.h_q:
        parts.append("gqa")
    return "+".join(parts) or "plain"


def _sdpa_either(rng, gen, a: Attn) -> Case:
    """Requests the contract leaves open: a library error, or a correct result."""
    q, k, v = a.tensors["clean"]
    m = rng.choice(
        [
            "expanded-kv",
            "expanded-batch",
            "br-sq-gt-skv",
            "window-sq-gt-skv",
            "alibi-no-causal",
            "br-with-bias",
            "causal-int-flag",
            "seed-negative",
            "all-meta",
        ]
    )
    ref = {"causal": None, "window": None, "alibi": False, "bias": None, "lq": None, "lkv": None}
    kw: dict = {"generate_stats": True}
    if m == "expanded-kv":  # stride 0 over K/V heads (cuDNN refuses zero strides)
        k = randn(gen, a.b, 1, a.s_kv, a.d_qk, dtype=a.dtype).expand(a.b, a.h_kv, -1, -1)
        v = randn(gen, a.b, 1, a.s_kv, a.d_v, dtype=a.dtype).expand(a.b, a.h_kv, -1, -1)
    elif m == "expanded-batch":
        q = randn(gen, 1, a.h_q, a.s_q, a.d_qk, dtype=a.dtype).expand(a.b, -1, -1, -1)
    elif m == "br-sq-gt-skv":  # bottom-right with S_q > S_kv and no lengths: the first rows see nothing
        q = randn(gen, a.b, a.h_q, a.s_kv + rng.randint(1, 4), a.d_qk, dtype=a.dtype)
        kw["use_causal_mask_bottom_right"], ref["causal"] = True, "bottom_right"
    elif m == "window-sq-gt-skv":
        q = randn(gen, a.b, a.h_q, a.s_kv + rng.randint(1, 4), a.d_qk, dtype=a.dtype)
        kw["sliding_window_length"] = ref["window"] = rng.randint(1, 4)
    elif m == "alibi-no-causal":
        kw["use_alibi_mask"], ref["alibi"] = True, True
    elif m == "br-with-bias":
        if a.s_q > a.s_kv:
            q = randn(gen, a.b, a.h_q, a.s_kv, a.d_qk, dtype=a.dtype)
        kw["attn_bias"] = ref["bias"] = randn(gen, 1, 1, q.shape[2], a.s_kv, dtype=a.dtype)
        kw["use_causal_mask_bottom_right"], ref["causal"] = True, "bottom_right"
    elif m == "causal-int-flag":
        kw["use_causal_mask"], ref["causal"] = 1, "top_left"
    elif m == "seed-negative":
        kw.update(dropout=0.0, dropout_seed=-5, dropout_offset=-1)
    if m in ("expanded-kv", "expanded-batch") and a.lq is not None and not a.nan_beyond_len:
        kw.update(use_padding_mask=True, seq_len_q=a.tensors["seq_len_q"], seq_len_kv=a.tensors["seq_len_kv"])
        ref["lq"], ref["lkv"] = a.lq, a.lkv
    if a.scale is not None:
        kw["attn_scale"] = a.scale
    if m == "all-meta":
        q, k, v = (x.to("meta") for x in (q, k, v))
    desc = f"g.sdpa either:{m} q={list(q.shape)}{list(q.stride())} k={list(k.shape)}{list(k.stride())} v={list(v.shape)} {str(a.dtype).removeprefix('torch.')} kwargs={_kwdesc(kw)}"

    def call(case):
        with _graph(rng=rng, backend=own_backend()) as g:
            g.sdpa(q, k, v, **kw)
        return g(*distinct([q, k, v, kw.get("attn_bias"), kw.get("seq_len_q"), kw.get("seq_len_kv")]))

    def check(result):
        o, stats = unpack_outputs(result, 2)
        if m == "all-meta":
            assert o.shape == (*q.shape[:-1], a.d_v), f"meta O shape {list(o.shape)}"
            return
        o_exp, lse = oracle.attention(
            q,
            k,
            v,
            scale=a.scale_value,
            causal=ref["causal"],
            window=ref["window"],
            seq_q=ref["lq"],
            seq_kv=ref["lkv"],
            bias=ref["bias"],
            alibi=ref["alibi"],
        )
        allowed = scores_mask(
            a.b, a.h_q, q.shape[2], k.shape[2], causal=ref["causal"], window=ref["window"], lq=ref["lq"], lkv=ref["lkv"]
        )
        assert_close("O", o, o_exp, tol(a.dtype), a.dtype, empty_rows(allowed, o_exp.shape))
        assert_close("Stats", stats, lse, REFERENCE_TOL, torch.float32)

    return _new_case(EITHER, f"sdpa/either/{m}", desc, call, check)


def _kwdesc(kw: dict) -> str:
    def short(v):
        if isinstance(v, np.ndarray):
            return f"ndarray{list(v.shape)}:{v.dtype}"
        if isinstance(v, torch.Tensor):
            return f"tensor{list(v.shape)}:{str(v.dtype).removeprefix('torch.')}@{v.device.type}"
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(short(x) for x in v) + ")"
        return repr(v) if not isinstance(v, int) or abs(v) < 10**12 else f"<int {len(str(v))} digits>"

    return "{" + ", ".join(f"{k}={short(v)}" for k, v in kw.items()) + "}"


def _sdpa_build_malformed(rng, gen, a: Attn) -> Case:
    t = a.tensors
    kw = sdpa_keywords(a)
    kw["generate_stats"] = rng.random() < 0.5
    roles = {"q": t["q"], "k": t["k"], "v": t["v"]}
    label, expect = mutate_request(rng, gen, a, kw, roles)
    graph_kw = roles.pop("__graph__", {})
    desc = f"g.sdpa {expect}:{label} base=({a.describe()}) q/k/v={_kwdesc(roles)} kwargs={_kwdesc(kw)} graph={graph_kw}"

    def call(case):
        with _graph(graph_kw, rng) as g:
            g.sdpa(roles["q"], roles["k"], roles["v"], **kw)
        args = distinct(
            [
                roles["q"],
                roles["k"],
                roles["v"],
                kw.get("attn_bias"),
                kw.get("bias"),
                kw.get("seq_len_q"),
                kw.get("seq_len_kv"),
            ]
            + [x for x in (kw.get("dropout_seed"), kw.get("dropout_offset")) if isinstance(x, torch.Tensor)]
            + dropout_tuple_tensors(kw)
        )
        args = [x for x in args if isinstance(x, (torch.Tensor, np.ndarray))]
        return g(*args)

    def check(result):  # only for EITHER outcomes (keys broadcast in the bias)
        o_exp, _ = oracle.attention(
            *t["clean"],
            scale=a.scale_value,
            causal=a.causal if a.causal != "bottom_right" else None,
            window=a.window,
            seq_q=a.lq,
            seq_kv=a.lkv,
            bias=kw.get("attn_bias"),
            alibi=a.alibi,
        )
        results = unpack_outputs(result, 2 if kw["generate_stats"] else 1)
        if a.p:
            return
        assert_close("O", results[0], o_exp, tol(a.dtype), a.dtype)

    def check_float32(result):  # q, k, v in float32: the same request in float32 precision
        results = unpack_outputs(result, 2 if kw["generate_stats"] else 1)
        o_exp, lse, empty, _ = expected_forward(a, results[0])
        assert_close("O", results[0], o_exp, tol(torch.float32), torch.float32, empty)
        if kw["generate_stats"]:
            assert_close("Stats", results[1], lse, REFERENCE_TOL, torch.float32)

    either_check = check_float32 if label == "q-float32-qkv" else check
    if label in RESIZED and expect != MALFORMED:
        case = _new_case(
            expect, f"sdpa/{expect}/{label}", desc, call, resized_forward_check(a, kw, roles, kw["generate_stats"])
        )
        case.errors, case.names = resized_refusal(label, a, kw)
        return case
    case = _new_case(expect, f"sdpa/malformed/{label}", desc, call, either_check if expect == EITHER else None)
    case.names = arguments_for(label, GRAPH_ARGUMENTS)
    return case


def _sdpa_runtime_malformed(rng, gen, a: Attn) -> Case:
    t = a.tensors
    kw = sdpa_keywords(a)
    kw["generate_stats"] = rng.random() < 0.5
    o_geom = _output_geometry(rng, a, t["q"])
    stats_geom = ((a.b, a.h_q, a.s_q, 1), contiguous_stride((a.b, a.h_q, a.s_q, 1)), torch.float32)
    outs_spec = [(*o_geom, a.dtype)] + ([stats_geom] if kw["generate_stats"] else [])
    inputs = forward_run_inputs(a)
    lengths = [
        (i, a.s_q if x is t.get("seq_len_q") else a.s_kv)
        for i, x in enumerate(inputs)
        if x is t.get("seq_len_q") or x is t.get("seq_len_kv")
    ]
    label, args, run_kw = runtime_mutation(rng, gen, inputs, outs_spec, lengths)
    desc = f"g(...) {label} on g.sdpa({a.describe()}) args={_kwdesc(dict(enumerate(args)))} {_kwdesc(run_kw)}"

    def call(case):
        with _graph(rng=rng) as g:
            o, stats = g.sdpa(t["q"], t["k"], t["v"], **kw)
            o.set_output(True).set_dim(o_geom[0]).set_stride(o_geom[1])
        name_run_inputs(case, g, inputs, args, label)
        return g(*args, **run_kw)

    return _new_case(MALFORMED, f"sdpa/{label}", desc, call)


def _sdpa_misuse(rng, gen, a: Attn) -> Case:
    t = a.tensors
    m = rng.choice(
        [
            "record-after-build",
            "setter-after-build",
            "empty-graph",
            "foreign-handle",
            "handle-as-run-input",
            "set-dim-wrong",
            "set-data-type-garbage",
            "set-data-type-float32",
            "set-stride-rank",
        ]
    )
    errors = MISUSE_ERRORS

    def call(case):
        q, k, v = t["q"], t["k"], t["v"]
        if m == "empty-graph":
            with _graph() as g:
                pass
            return g
        if m == "foreign-handle":
            with _graph() as g1:
                o1, _ = g1.sdpa(q, k, v)
            with _graph() as g2:
                g2.sdpa(o1, k, v)
            return g2(k, v)
        with _graph() as g:
            o, _ = g.sdpa(q, k, v)
            if m == "set-dim-wrong":
                o.set_dim([a.b, a.h_q, a.s_q + 1, a.d_v])
            elif m == "set-data-type-garbage":
                o.set_data_type("complex")
            elif m == "set-data-type-float32":
                o.set_data_type(torch.float32)
            elif m == "set-stride-rank":
                o.set_stride([1, 1])
        if m == "record-after-build":
            g.sdpa(q, k, v)
        elif m == "setter-after-build":
            o.set_dim([a.b, a.h_q, a.s_q, a.d_v])
        elif m == "handle-as-run-input":
            return g(o, k, v)
        return g(q, k, v)

    desc = f"misuse:{m} on g.sdpa({a.describe()})"
    return _new_case(MALFORMED, f"sdpa/misuse/{m}", desc, call, errors=errors)


# ---- op: Graph.sdpa with ragged (THD) inputs -----------------------------------------------------------


def _pack(dense: torch.Tensor, lengths: list, total: int) -> torch.Tensor:
    """[B, H, S, D] -> [total, H, D]: each sequence's first lengths[b] rows back to back."""
    parts = [dense[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)]
    out = torch.cat(parts) if parts else dense.new_zeros(0, dense.shape[1], dense.shape[3])
    return (
        out[:total] if out.shape[0] >= total else torch.cat([out, out.new_zeros(total - out.shape[0], *out.shape[1:])])
    )


def _thd_case(rng: random.Random, gen: torch.Generator) -> Case:
    dtype = pick(rng, IO_DTYPES)
    b = rng.choice([1, 2, 2, 3])
    h_q = rng.choice([1, 2, 3, 4])
    h_kv = rng.choice([d for d in (1, 2, 3, 4) if h_q % d == 0])
    d, d_v = rng.choice([8, 16]), rng.choice([8, 16])
    lq = [rng.randint(0 if rng.random() < 0.15 else 1, 8) for _ in range(b)]
    lkv = [rng.randint(0 if rng.random() < 0.15 else 1, 8) for _ in range(b)]
    extra_q, extra_kv = rng.choice([0, 0, 0, 2]), rng.choice([0, 0, 0, 3])
    t_q, t_kv = max(sum(lq) + extra_q, 1), max(sum(lkv) + extra_kv, 1)
    max_q = rng.choice([None, None, max(max(lq), 1) + rng.randint(0, 2)])
    max_kv = rng.choice([None, None, max(max(lkv), 1) + rng.randint(0, 2)])
    max_q = None if max_q is not None and max_q > t_q else max_q
    max_kv = None if max_kv is not None and max_kv > t_kv else max_kv
    s_q, s_kv = max_q or t_q, max_kv or t_kv  # the padded lengths the lengths are measured against
    causal = rng.choice([None, None, "top_left", "bottom_right"])
    window = rng.randint(1, 6) if rng.random() < 0.2 else None
    scale = rng.choice([None, None, 0.2, 1.0])
    layouts = [rng.choice(["THD", "THD", "padded", "HBSD", "offset"]) for _ in range(3)]
    q_dense = randn(gen, b, h_q, s_q, d, dtype=dtype)
    k_dense = randn(gen, b, h_kv, s_kv, d, dtype=dtype)
    v_dense = randn(gen, b, h_kv, s_kv, d_v, dtype=dtype)
    packed = []  # the sequences back to back, then random tokens that belong to no sequence
    for dense, lengths, total in ((q_dense, lq, t_q), (k_dense, lkv, t_kv), (v_dense, lkv, t_kv)):
        x = randn(gen, total, dense.shape[1], dense.shape[3], dtype=dtype)
        n = sum(lengths)
        x[:n] = _pack(dense, lengths, n)
        packed.append(x)
    q, k, v = (to_layout(x, lay) for x, lay in zip(packed, layouts))
    seq_q, seq_kv = _int32(lq), _int32(lkv)
    kw = {"seq_len_q": seq_q, "seq_len_kv": seq_kv}
    if rng.random() < 0.7:
        kw["use_padding_mask"] = True
    if max_q is not None:
        kw["max_seq_len_q"] = max_q
    if max_kv is not None:
        kw["max_seq_len_kv"] = max_kv
    if causal == "top_left":
        kw["use_causal_mask"] = True
    elif causal == "bottom_right":
        kw["use_causal_mask_bottom_right"] = True
    if window is not None:
        kw["sliding_window_length"] = window
    if scale is not None:
        kw["attn_scale"] = scale
    want_stats = rng.random() < 0.5
    kw["generate_stats"] = want_stats
    base = f"THD {str(dtype).removeprefix('torch.')} b{b} h{h_q}/{h_kv} d{d}/{d_v} seq_len_q={lq} seq_len_kv={lkv} T={t_q}/{t_kv} layouts={layouts} kwargs={_kwdesc(kw)}"
    r = rng.random()
    if r < 0.5:
        use_out = rng.random() < 0.4

        def call(case):
            with _graph(rng=rng) as g:
                o, stats = g.sdpa(q, k, v, **kw)
                if use_out:
                    o.set_dim([t_q, h_q, d_v]).set_stride(contiguous_stride((t_q, h_q, d_v)))
            run_kw = {}
            if use_out:
                outs = [poisoned((t_q, h_q, d_v), contiguous_stride((t_q, h_q, d_v)), dtype)]
                if want_stats:
                    shape = tuple(stats.shape)
                    outs.append(poisoned(shape, contiguous_stride(shape), torch.float32))
                run_kw["out"] = outs[0] if len(outs) == 1 else tuple(outs)
            return g(q, k, v, seq_q, seq_kv, **run_kw)

        def check(result):
            results = unpack_outputs(result, 2 if want_stats else 1)
            o_exp, lse = oracle.attention(
                q_dense,
                k_dense,
                v_dense,
                scale=scale if scale is not None else d**-0.5,
                causal=causal,
                window=window,
                seq_q=lq,
                seq_kv=lkv,
            )
            n = sum(lq)
            o = as_tensor(results[0])
            assert tuple(o.shape) == (t_q, h_q, d_v), f"O: shape {list(o.shape)}, expected {[t_q, h_q, d_v]}"
            assert_close("O (tokens of the sequences)", o[:n], _pack(o_exp, lq, n), tol(dtype), dtype)
            if want_stats:  # [B, H, S_max, 1]: rows past each sequence's length are fully masked (-inf)
                stats = as_tensor(results[1])
                assert (
                    stats.dim() == 4
                    and tuple(stats.shape[:2]) == (b, h_q)
                    and stats.shape[3] == 1
                    and stats.shape[2] >= max(lq)
                ), f"Stats: shape {list(stats.shape)}"
                rows = stats.shape[2]
                if rows > s_q:
                    lse = torch.cat([lse, lse.new_full((b, h_q, rows - s_q, 1), float("-inf"))], 2)
                assert_close("Stats", stats, lse[:, :, :rows], REFERENCE_TOL, torch.float32)

        label = (
            "+".join(
                x
                for x in (
                    causal,
                    "window" if window else "",
                    "gqa" if h_kv != h_q else "",
                    "max_seq_len" if (max_q or max_kv) else "",
                    "extra-tokens" if (extra_q or extra_kv) else "",
                )
                if x
            )
            or "plain"
        )
        return _new_case(VALID, f"sdpa_thd/valid/{label}", "g.sdpa " + base, call, check)
    if r < 0.65:
        inputs = [q, k, v, seq_q, seq_kv]
        label, args, run_kw = runtime_mutation(rng, gen, inputs, None, [(3, s_q), (4, s_kv)])

        def call(case):
            with _graph(rng=rng) as g:
                g.sdpa(q, k, v, **kw)
            name_run_inputs(case, g, inputs, args, label)
            return g(*args, **run_kw)

        return _new_case(MALFORMED, f"sdpa_thd/{label}", f"g(...) {label} on " + base, call)
    # build-time malformations specific to ragged inputs
    m = rng.choice(
        [
            "sum-over-T",
            "len-over-max",
            "len-negative",
            "k-rank4",
            "no-seq-len-kv",
            "len-shapes-differ",
            "tk-ne-tv",
            "max-zero",
            "max-float",
            "max-bool",
            "no-seq-len-q",
            "padding-false",
        ]
    )
    kw2 = dict(kw)
    q2, k2, v2 = q, k, v
    expect = MALFORMED
    if m == "sum-over-T":
        kw2["seq_len_q"] = _int32([t_q] * max(b, 2)) if b > 1 else _int32([t_q + 1])
        kw2["seq_len_kv"] = _int32(lkv + [1] * (max(b, 2) - b)) if b == 1 else seq_kv
        kw2.pop("max_seq_len_q", None)
    elif m == "len-over-max":
        kw2["max_seq_len_q"] = max(max(lq), 2) - 1
        if max(lq) <= 1:
            kw2["seq_len_q"] = _int32([2] + lq[1:])
    elif m == "len-negative":
        kw2["seq_len_kv"] = _int32([-1] + lkv[1:])
    elif m == "k-rank4":
        k2 = randn(gen, b, h_kv, s_kv, d, dtype=dtype)
    elif m == "no-seq-len-kv":
        kw2.pop("seq_len_kv")
    elif m == "no-seq-len-q":
        kw2.pop("seq_len_q")
    elif m == "len-shapes-differ":
        kw2["seq_len_kv"] = _int32(lkv + [1])
    elif m == "tk-ne-tv":
        v2 = randn(gen, t_kv + 1, h_kv, d_v, dtype=dtype)
    elif m == "max-zero":
        kw2["max_seq_len_q"] = 0
    elif m == "max-float":
        kw2["max_seq_len_q"] = float(max(max(lq), 1))
    elif m == "max-bool":
        kw2["max_seq_len_kv"] = True
    elif m == "padding-false":
        kw2["use_padding_mask"] = False  # ragged inputs need the padding mask: either refused, or run with it
        expect = EITHER
    desc = f"g.sdpa THD malformed:{m} base=({base}) kwargs={_kwdesc(kw2)} k={_kwdesc({'k': k2, 'v': v2})}"

    def call(case):
        with _graph(rng=rng) as g:
            g.sdpa(q2, k2, v2, **kw2)
        return g(*distinct([q2, k2, v2, kw2.get("seq_len_q"), kw2.get("seq_len_kv")]))

    def check(result):
        results = unpack_outputs(result, 2 if want_stats else 1)
        o_exp, _ = oracle.attention(
            q_dense,
            k_dense,
            v_dense,
            scale=scale if scale is not None else d**-0.5,
            causal=causal,
            window=window,
            seq_q=lq,
            seq_kv=lkv,
        )
        n = sum(lq)
        assert_close("O (tokens of the sequences)", as_tensor(results[0])[:n], _pack(o_exp, lq, n), tol(dtype), dtype)

    case = _new_case(expect, f"sdpa_thd/malformed/{m}", desc, call, check if expect == EITHER else None)
    case.names = arguments_for(m, THD_ARGUMENTS)
    return case


# ---- op: Graph.sdpa_backward -------------------------------------------------------------------------------


def _backward_case(rng: random.Random, gen: torch.Generator) -> Case:
    if rng.random() < 0.15:
        return _thd_backward_case(rng, gen)
    a = draw_attn(rng, gen, backward=True)
    t = a.tensors
    q, k, v = t["clean"]
    allowed, bias = a.allowed(), a.bias64()
    o_layout = rng.choice(DENSE_LAYOUTS) if rng.random() < 0.4 else a.layouts[0].replace("BS3HD", "BSHD")
    d_o = to_layout(randn(gen, a.b, a.h_q, a.s_q, a.d_v, dtype=a.dtype), rng.choice(DENSE_LAYOUTS))
    probs = probs64(q, k, scale=a.scale_value, allowed=allowed, bias=bias)
    vv = v.double().repeat_interleave(a.h_q // a.h_kv, 1)
    o64 = probs @ vv
    s = (q.double() @ k.double().repeat_interleave(a.h_q // a.h_kv, 1).transpose(-1, -2)) * a.scale_value
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    o = to_layout(o64.to(a.dtype), o_layout)
    stats = lse.float()
    kw = sdpa_keywords(a)
    kw["use_deterministic_algorithm"] = rng.random() < 0.3
    r = rng.random()
    combined = bool(a.p) or rng.random() < 0.25  # dropout: the forward of the same graph gives O (and the mask)
    base = f"{a.describe()} combined={combined} o_layout={o_layout} deterministic={kw['use_deterministic_algorithm']}"
    if r < 0.5:
        use_out = not combined and rng.random() < 0.5
        state = {}

        def call(case):
            with _graph(rng=rng) as g:
                if combined:
                    fkw = {x: y for x, y in kw.items() if x != "use_deterministic_algorithm"}
                    o_h, s_h = g.sdpa(t["q"], t["k"], t["v"], generate_stats=True, **fkw)
                    grads = g.sdpa_backward(t["q"], t["k"], t["v"], o_h, d_o, s_h, **kw)
                else:
                    grads = g.sdpa_backward(t["q"], t["k"], t["v"], o, d_o, stats, **kw)
                geoms = []
                for h, x in zip(grads, (t["q"], t["k"], t["v"])):
                    geom = (tuple(x.shape), strides_like(tuple(x.shape), x.stride()))
                    geoms.append(geom)
                    if use_out:
                        h.set_dim(geom[0]).set_stride(geom[1])
            run_kw = {}
            if combined:
                args = forward_run_inputs(a) + [d_o]
            else:
                args = distinct(
                    [
                        t["q"],
                        t["k"],
                        t["v"],
                        o,
                        d_o,
                        stats,
                        t.get("bias"),
                        t.get("seq_len_q"),
                        t.get("seq_len_kv"),
                        t.get("seed"),
                        t.get("offset"),
                    ]
                )
            outs = [poisoned(s_, st, a.dtype) for s_, st in geoms] if use_out else None
            if outs:
                run_kw["out"] = tuple(outs)
            state["outs"] = outs
            return g(*args, **run_kw)

        def check(result):
            results = unpack_outputs(result, 5 if combined else 3)
            keep = None
            o_given = o
            if combined:
                o_f = as_tensor(results[0])
                o_exp, lse_exp, empty, keep = expected_forward(a, o_f)
                assert_close("O (forward node)", o_f, o_exp, tol(a.dtype), a.dtype, empty)
                assert_close("Stats (forward node)", results[1], lse_exp, REFERENCE_TOL, torch.float32)
                o_given = o_f
                results = results[2:]
            _check_grads(results, a, q, k, v, o_given, d_o, allowed, bias, keep)
            check_out_buffers(results, state["outs"])

        return _new_case(
            VALID,
            "sdpa_backward/valid/" + _features(a) + ("+fused" if combined else ""),
            "g.sdpa_backward " + base,
            call,
            check,
        )
    if r < 0.68:
        inputs = distinct(
            [
                t["q"],
                t["k"],
                t["v"],
                o,
                d_o,
                stats,
                t.get("bias"),
                t.get("seq_len_q"),
                t.get("seq_len_kv"),
                t.get("seed"),
                t.get("offset"),
            ]
        )
        outs_spec = [
            (tuple(x.shape), strides_like(tuple(x.shape), x.stride()), a.dtype) for x in (t["q"], t["k"], t["v"])
        ]
        lengths = [
            (i, a.s_q if x is t.get("seq_len_q") else a.s_kv)
            for i, x in enumerate(inputs)
            if x is t.get("seq_len_q") or x is t.get("seq_len_kv")
        ]
        label, args, run_kw = runtime_mutation(rng, gen, inputs, outs_spec, lengths)

        def call(case):
            with _graph(rng=rng) as g:
                grads = g.sdpa_backward(t["q"], t["k"], t["v"], o, d_o, stats, **kw)
                for h, (s_, st, _) in zip(grads, outs_spec):
                    h.set_dim(s_).set_stride(st)
            name_run_inputs(case, g, inputs, args, label)
            return g(*args, **run_kw)

        return _new_case(
            MALFORMED,
            f"sdpa_backward/{label}",
            f"g(...) {label} on g.sdpa_backward({base}) args={_kwdesc(dict(enumerate(args)))} {_kwdesc(run_kw)}",
            call,
        )
    roles = {"q": t["q"], "k": t["k"], "v": t["v"], "o": o, "dO": d_o, "stats": stats}
    label, expect = mutate_request(rng, gen, a, kw, roles, backward=True)
    resized = label in RESIZED and expect != MALFORMED
    if resized:  # the O and stats of its own forward (the mutation made o, dO afresh and kept the old stats)
        o64, lse64, _ = resized_expected(a, kw, roles["q"], roles["k"], roles["v"])
        roles["o"], roles["stats"] = o64.to(a.dtype), lse64.float()
    graph_kw = roles.pop("__graph__", {})
    desc = (
        f"g.sdpa_backward {expect}:{label} base=({base}) tensors={_kwdesc(roles)} kwargs={_kwdesc(kw)} graph={graph_kw}"
    )

    def call(case):
        with _graph(graph_kw, rng) as g:
            g.sdpa_backward(roles["q"], roles["k"], roles["v"], roles["o"], roles["dO"], roles["stats"], **kw)
        args = distinct(
            [roles[r] for r in ("q", "k", "v", "o", "dO", "stats")]
            + [kw.get("attn_bias"), kw.get("bias"), kw.get("seq_len_q"), kw.get("seq_len_kv")]
            + [x for x in (kw.get("dropout_seed"), kw.get("dropout_offset")) if isinstance(x, torch.Tensor)]
            + dropout_tuple_tensors(kw)
        )
        args = [x for x in args if isinstance(x, (torch.Tensor, np.ndarray))]
        return g(*args)

    def check(result):  # EITHER (bias broadcast over keys): its gradients, given the o that was passed
        results = unpack_outputs(result, 3)
        if a.p:
            return
        causal = a.causal if a.causal != "bottom_right" else None
        a2 = Attn(
            a.dtype,
            a.b,
            a.h_q,
            a.h_kv,
            a.s_q,
            a.s_kv,
            a.d_qk,
            a.d_v,
            causal=causal,
            window=a.window,
            alibi=a.alibi,
            lq=a.lq,
            lkv=a.lkv,
            scale=a.scale,
        )
        bias2 = kw["attn_bias"].double().expand(a.b, a.h_q, a.s_q, a.s_kv)
        if a.alibi:
            bias2 = bias2 + alibi_bias64(a.h_q, a.s_q, a.s_kv)
        _check_grads(results, a2, q, k, v, roles["o"], roles["dO"], a2.allowed(), bias2, None)

    if resized:
        case = _new_case(expect, f"sdpa_backward/{expect}/{label}", desc, call, resized_backward_check(a, kw, roles))
        case.errors, case.names = resized_refusal(label, a, kw)
        return case
    case = _new_case(expect, f"sdpa_backward/malformed/{label}", desc, call, check if expect == EITHER else None)
    case.names = arguments_for(label, GRAPH_ARGUMENTS)
    return case


def _check_grads(results, a: Attn, q, k, v, o_given, d_o, allowed, bias, keep, names=("dQ", "dK", "dV")):
    d_q, d_k, d_v, _ = grads64(
        q, k, v, as_tensor(o_given), d_o, scale=a.scale_value, allowed=allowed, bias=bias, keep=keep, p=a.p
    )
    for name, actual, expected in zip(names, results, (d_q, d_k, d_v)):
        assert_close(name, actual, expected, tol(a.dtype), a.dtype)
    # the formula itself, against autograd of the oracle: both with the exact float64 O
    leaves = [x.double().detach().requires_grad_() for x in (q, k, v)]
    out = oracle.attention_autograd(*leaves, scale=a.scale_value, allowed=allowed, bias=bias, keep=keep, p=a.p)
    out.backward(d_o.double())
    exact = grads64(q, k, v, out.detach(), d_o, scale=a.scale_value, allowed=allowed, bias=bias, keep=keep, p=a.p)
    for name, expected, leaf in zip(names, exact, leaves):
        err = rel_err(expected, leaf.grad)
        assert err < 1e-7, f"{name}: the float64 formula and autograd disagree ({err:.3g}): a bug of this fuzz file"


def _thd_backward_case(rng: random.Random, gen: torch.Generator) -> Case:
    dtype = pick(rng, IO_DTYPES)
    b = rng.choice([1, 2, 3])
    h_q = rng.choice([1, 2, 4])
    h_kv = rng.choice([x for x in (1, 2, 4) if h_q % x == 0])
    d = rng.choice([8, 16])
    lq = [rng.randint(1, 6) for _ in range(b)]
    lkv = [rng.randint(1, 6) for _ in range(b)]
    s_q, s_kv = max(lq), max(lkv)
    causal = rng.choice([None, "top_left", "bottom_right"])
    qd = randn(gen, b, h_q, s_q, d, dtype=dtype)
    kd, vd = randn(gen, b, h_kv, s_kv, d, dtype=dtype), randn(gen, b, h_kv, s_kv, d, dtype=dtype)
    t_q, t_kv = sum(lq), sum(lkv)
    q, k, v = _pack(qd, lq, t_q), _pack(kd, lkv, t_kv), _pack(vd, lkv, t_kv)
    seq_q, seq_kv = _int32(lq), _int32(lkv)
    allowed = scores_mask(b, h_q, s_q, s_kv, causal=causal, lq=lq, lkv=lkv)
    probs = probs64(qd, kd, scale=d**-0.5, allowed=allowed)
    o_dense = (probs @ vd.double().repeat_interleave(h_q // h_kv, 1)).to(dtype)
    o = _pack(o_dense, lq, t_q)
    d_o_dense = randn(gen, b, h_q, s_q, d, dtype=dtype)
    valid_rows = torch.arange(s_q).view(1, 1, -1, 1) < torch.tensor(lq).view(-1, 1, 1, 1)
    d_o_dense = torch.where(valid_rows, d_o_dense, torch.zeros_like(d_o_dense))
    d_o = _pack(d_o_dense, lq, t_q)
    sc = (qd.double() @ kd.double().repeat_interleave(h_q // h_kv, 1).transpose(-1, -2)) * d**-0.5
    sc = sc.masked_fill(~allowed, float("-inf"))
    stats = torch.logsumexp(sc, -1, keepdim=True).float()
    kw = {
        "seq_len_q": seq_q,
        "seq_len_kv": seq_kv,
        "max_seq_len_q": s_q,
        "max_seq_len_kv": s_kv,
        "use_causal_mask": causal == "top_left",
        "use_causal_mask_bottom_right": causal == "bottom_right",
    }
    desc = f"g.sdpa_backward THD {str(dtype).removeprefix('torch.')} b{b} h{h_q}/{h_kv} d{d} seq_len_q={lq} seq_len_kv={lkv} causal={causal}"

    def call(case):
        with _graph(rng=rng) as g:
            g.sdpa_backward(q, k, v, o, d_o, stats, **kw)
        return g(q, k, v, o, d_o, stats, seq_q, seq_kv)

    def check(result):
        d_q, d_k, d_v = unpack_outputs(result, 3)
        e_q, e_k, e_v, _ = grads64(qd, kd, vd, o_dense, d_o_dense, scale=d**-0.5, allowed=allowed)
        assert_close("dQ", d_q, _pack(e_q, lq, t_q), tol(dtype), dtype)
        assert_close("dK", d_k, _pack(e_k, lkv, t_kv), tol(dtype), dtype)
        assert_close("dV", d_v, _pack(e_v, lkv, t_kv), tol(dtype), dtype)

    return _new_case(VALID, "sdpa_backward/valid/thd" + (f"+{causal}" if causal else ""), desc, call, check)


# ---- op: Graph.sdpa_with_paged_cache -------------------------------------------------------------------------


def _paged_square_probe(rng: random.Random, gen: torch.Generator) -> Case:
    """An [N, H_kv, P, D] cache with P == H_kv and no way given to tell the readings apart (the contract's
    sdpa has no layout keyword): a library error asking which, or the right result; never the other reading."""
    dtype = pick(rng, IO_DTYPES)
    h_q = rng.choice([2, 4])
    h_kv = rng.choice([x for x in (2, 4) if h_q % x == 0])
    b, d, s_q, per_seq = rng.choice([1, 2]), rng.choice([8, 16]), rng.choice([1, 2]), rng.randint(1, 3)
    num_pages = b * per_seq + 1
    q = randn(gen, b, h_q, s_q, d, dtype=dtype)
    k, v = randn(gen, num_pages, h_kv, h_kv, d, dtype=dtype), randn(gen, num_pages, h_kv, h_kv, d, dtype=dtype)
    table = torch.randperm(num_pages, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)
    lkv = [rng.randint(1, per_seq * h_kv) for _ in range(b)]
    seq_kv = _int32(lkv)
    desc = f"g.sdpa(q{list(q.shape)}, NHPD cache {list(k.shape)} (page_size == H_kv == {h_kv}), paged_attention_k_table={table.tolist()}, seq_len_kv={lkv}) {str(dtype).removeprefix('torch.')}"

    def call(case):
        with _graph(rng=rng) as g:
            g.sdpa(q, k, v, use_padding_mask=True, seq_len_kv=seq_kv, paged_attention_k_table=table)
        return g(q, k, v, seq_kv, table)

    def check(result):
        k_dense, v_dense = _gather(k, table, "NHPD", per_seq * h_kv), _gather(v, table, "NHPD", per_seq * h_kv)
        o_exp, _ = oracle.attention(q, k_dense, v_dense, scale=d**-0.5, seq_kv=lkv)
        assert_close("O (the cache read as NHPD)", unpack_outputs(result, 1)[0], o_exp, tol(dtype), dtype)

    return _new_case(EITHER, "paged/either/square-cache-NHPD-implicit", desc, call, check)


def _paged_case(rng: random.Random, gen: torch.Generator) -> Case:
    if rng.random() < 0.04:
        return _paged_square_probe(rng, gen)
    dtype = pick(rng, IO_DTYPES)
    b = rng.choice([1, 2, 3])
    h_q = rng.choice([1, 2, 4, 4])
    h_kv = rng.choice([x for x in (1, 2, 4) if h_q % x == 0])
    d = rng.choice([8, 16])
    s_q = rng.choice([1, 1, 1, 2, 3, 5])
    page = rng.choice([1, 2, 3, 4, 5, 6, 8])
    per_seq = rng.randint(1, max(1, 16 // page))
    num_pages = b * per_seq + rng.randint(0, 3)
    layout = rng.choice(["NPHD", "NHPD"])
    # The other reading ([N, H, P, D] for [N, P, H, D]) is also a valid cache when P divides H_q: then
    # only kv_cache_layout says which it is (page_size == H_kv included: the readings are transposes).
    ambiguous = h_q % page == 0 and not (page == 1 and h_kv == 1)
    explicit_layout = ambiguous or rng.random() < 0.15
    capacity = per_seq * page
    max_kv = rng.choice([None, None, None, rng.randint(1, capacity)])
    s_kv = max_kv or capacity
    lkv = [rng.randint(0 if rng.random() < 0.1 else 1, s_kv) for _ in range(b)]
    give_lq = rng.random() < 0.3
    lq = [rng.randint(0, s_q) for _ in range(b)] if give_lq else [s_q] * b
    causal = rng.choice([None, None, "top_left", "bottom_right", "bottom_right"])
    window = rng.randint(1, 6) if rng.random() < 0.15 else None
    scale = rng.choice([None, None, 0.25, 1.0])
    table_form = rng.choice(["B,n", "B,n", "B,1,n,1"])
    separate_v = rng.random() < 0.3
    q_layout = rng.choice(DENSE_LAYOUTS) if rng.random() < 0.4 else "BHSD"
    q_dense = randn(gen, b, h_q, s_q, d, dtype=dtype)
    q = to_layout(q_dense, q_layout)
    shape = (num_pages, page, h_kv, d) if layout == "NPHD" else (num_pages, h_kv, page, d)
    k_cache, v_cache = randn(gen, *shape, dtype=dtype), randn(gen, *shape, dtype=dtype)
    if rng.random() < 0.2:
        v_cache = k_cache  # one cache for both
    table_k = torch.randint(0, num_pages, (b, per_seq), generator=gen, dtype=torch.int32)
    if rng.random() < 0.6 and num_pages >= b * per_seq:
        table_k = torch.randperm(num_pages, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)
    table_v = torch.randint(0, num_pages, (b, per_seq), generator=gen, dtype=torch.int32) if separate_v else table_k

    def shaped(table):
        return table.view(b, 1, per_seq, 1) if table_form == "B,1,n,1" else table

    pt_k, pt_v = shaped(table_k), shaped(table_v) if separate_v else None
    len_shape = rng.choice(["B", "B", "B111"])
    seq_kv = _int32(lkv).view((b,) if len_shape == "B" else (b, 1, 1, 1))
    seq_q = _int32(lq).view((b,) if len_shape == "B" else (b, 1, 1, 1)) if give_lq else None
    mask_kw = {}
    if causal == "top_left":
        mask_kw["use_causal_mask"] = True
    elif causal == "bottom_right":
        mask_kw["use_causal_mask_bottom_right"] = True
    if window is not None:
        mask_kw["sliding_window_length"] = window
    if scale is not None:
        mask_kw["attn_scale"] = scale
    sdpa_form = rng.random() < 0.25 and not ambiguous and not explicit_layout
    base = (
        f"{'g.sdpa(paged_attention_*)' if sdpa_form else 'g.sdpa_with_paged_cache'} {str(dtype).removeprefix('torch.')} "
        f"b{b} h{h_q}/{h_kv} d{d} s_q={s_q} q_layout={q_layout} cache={layout}{list(shape)} page={page} pages/seq={per_seq} "
        f"table={table_form}{' +separate v table' if separate_v else ''} max_seq_len_kv={max_kv} seq_len_kv={lkv} "
        f"seq_len_q={lq if give_lq else None} ({len_shape}) kv_cache_layout={'explicit' if explicit_layout else 'inferred'} "
        f"masks={_kwdesc(mask_kw)} same_cache={v_cache is k_cache}"
    )

    def record(g, q_=q, k_=k_cache, v_=v_cache, ptk=pt_k, ptv=pt_v, skv=seq_kv, sq=seq_q, extra=None):
        extra = dict(extra or {})
        if sdpa_form:
            kw = dict(mask_kw, use_padding_mask=True, seq_len_kv=skv, paged_attention_k_table=ptk)
            if sq is not None:
                kw["seq_len_q"] = sq
            if ptv is not None:
                kw["paged_attention_v_table"] = ptv
            if max_kv is not None:
                kw["paged_attention_max_seq_len_kv"] = max_kv
            kw.update(extra)
            return g.sdpa(q_, k_, v_, **kw)
        kw = dict(mask_kw, seq_len_kv=skv)
        if sq is not None:
            kw["seq_len_q"] = sq
        if ptv is not None:
            kw["page_table_v"] = ptv
        if max_kv is not None:
            kw["max_seq_len_kv"] = max_kv
        if explicit_layout:
            kw["kv_cache_layout"] = layout
        kw.update(extra)
        return g.sdpa_with_paged_cache(q_, k_, v_, ptk, **kw)

    def contract_inputs(q_=q, k_=k_cache, v_=v_cache, ptk=pt_k, ptv=pt_v, skv=seq_kv, sq=seq_q):
        if sdpa_form:  # sdpa's order: q, k, v, (bias), seq_len_q, seq_len_kv, ..., paged tables
            return distinct([q_, k_, v_, sq, skv, ptk, ptv])
        return distinct([q_, k_, v_, ptk, sq, skv, ptv])  # sdpa_with_paged_cache's own parameter order

    r = rng.random()
    if r < 0.5:
        use_out = rng.random() < 0.4
        out_geom = ((b, h_q, s_q, d), strides_like((b, h_q, s_q, d), q.stride()))

        def call(case):
            with _graph(rng=rng) as g:
                o, second = record(g)
                if use_out:
                    o.set_dim(out_geom[0]).set_stride(out_geom[1])
            assert second is None, "sdpa_with_paged_cache must return (O, None)"
            run_kw = {"out": poisoned(*out_geom, dtype)} if use_out else {}
            by_name = _paged_by_name(g, q, k_cache, v_cache, pt_k, pt_v, seq_q, seq_kv)
            order = "q, k, v, page_table, seq_len_q, seq_len_kv, page_table_v"
            try:
                result = g(*contract_inputs(), **run_kw)
            except LIBRARY_ERRORS as error:
                if sdpa_form or by_name is None:
                    raise
                case.note(
                    f"valid request refused ({type(error).__name__}) in the contract's positional order {order}",
                    _first_line(error),
                    label="paged/positional-order",
                )
                run_kw = {"out": poisoned(*out_geom, dtype)} if use_out else {}
                result = g(by_name, **run_kw)
            else:
                if not sdpa_form and by_name is not None:  # inputs of equal shapes may have been swapped silently
                    again = g(by_name)
                    if not torch.equal(as_tensor(again).nan_to_num(), as_tensor(result).nan_to_num()):
                        case.note(
                            f"wrong result: the contract's positional order {order} is read in another order "
                            "(page table and lengths of equal shape swapped silently)",
                            "results differ from the by-name run",
                            label="paged/positional-order",
                        )
                        result, run_kw = again, {}
            if use_out and "out" in run_kw:
                assert as_tensor(result).data_ptr() == run_kw["out"].data_ptr(), "result is not the out= buffer"
            return result

        def check(result):
            k_dense = _gather(k_cache, table_k, layout, s_kv)
            v_dense = _gather(v_cache, table_v, layout, s_kv)
            o_exp, _ = oracle.attention(
                q_dense,
                k_dense,
                v_dense,
                scale=scale if scale is not None else d**-0.5,
                causal=causal,
                window=window,
                seq_q=lq,
                seq_kv=lkv,
            )
            allowed = scores_mask(b, h_q, s_q, s_kv, causal=causal, window=window, lq=lq, lkv=lkv)
            assert_close("O", unpack_outputs(result, 1)[0], o_exp, tol(dtype), dtype, empty_rows(allowed, o_exp.shape))

        label = "+".join(
            x
            for x in (
                causal or "",
                "window" if window else "",
                "gqa" if h_kv != h_q else "",
                "decode" if s_q == 1 else "prefill",
                layout,
                "sdpa-form" if sdpa_form else "",
            )
            if x
        )
        return _new_case(VALID, f"paged/valid/{label}", base, call, check)
    if r < 0.65:
        inputs = contract_inputs()
        lengths = [(i, s_kv) for i, x in enumerate(inputs) if x is seq_kv]
        # swapping a page table with a length tensor is the library's own order (see the valid cases)
        tables = [i for i, x in enumerate(inputs) if x is pt_k or x is pt_v]
        lens = [i for i, x in enumerate(inputs) if x is seq_kv or x is seq_q]
        no_swap = [{x, y} for x in tables for y in lens]
        out_spec = [((b, h_q, s_q, d), strides_like((b, h_q, s_q, d), q.stride()), dtype)]
        label, args, run_kw = runtime_mutation(rng, gen, inputs, out_spec, lengths, no_swap)

        def call(case):
            with _graph(rng=rng) as g:
                o, _ = record(g)
                o.set_dim((b, h_q, s_q, d)).set_stride(strides_like((b, h_q, s_q, d), q.stride()))
            name_run_inputs(case, g, inputs, args, label)
            return g(*args, **run_kw)

        return _new_case(MALFORMED, f"paged/{label}", f"g(...) {label} on {base}", call)
    m = rng.choice(
        [
            "cache-rank3",
            "table-int64",
            "table-rows",
            "table-rank3",
            "table-index-high",
            "table-index-neg",
            "no-seq-len-kv",
            "seq-len-kv-over",
            "seq-len-kv-neg",
            "seq-len-kv-int16",
            "v-cache-shape",
            "cache-dtype",
            "layout-name",
            "max-over",
            "max-zero",
            "max-bool",
            "table-None",
            "kv-heads",
            "table-float",
            "q-thd",
            "table-meta",
            "seq-len-q-over",
            "table-nontensor",
            "cache-last-stride",
        ]
    )
    q2, k2, v2, ptk, ptv, skv, sq, extra = q, k_cache, v_cache, pt_k, pt_v, seq_kv, seq_q, {}
    expect = MALFORMED
    used = [(bi, j) for bi in range(b) for j in range(per_seq) if j * page < lkv[bi]] or [(0, 0)]
    if m == "cache-rank3":
        k2 = k_cache[0]
    elif m == "table-int64":
        ptk = pt_k.long()
    elif m == "table-rows":
        ptk = torch.zeros(b + 1, per_seq, dtype=torch.int32)
    elif m == "table-rank3":
        ptk = table_k.view(b, per_seq, 1)
    elif m in ("table-index-high", "table-index-neg"):
        bad = table_k.clone()
        bi, j = rng.choice(used)
        bad[bi, j] = num_pages + rng.randint(0, 5) if m == "table-index-high" else -1
        ptk = shaped(bad)
    elif m == "no-seq-len-kv":
        skv = None
    elif m == "seq-len-kv-over":
        skv = _int32([s_kv + 1] + lkv[1:])
    elif m == "seq-len-kv-neg":
        skv = _int32([-1] + lkv[1:])
    elif m == "seq-len-kv-int16":
        skv = _int32(lkv).to(torch.int16)
    elif m == "seq-len-q-over":
        sq = _int32([s_q + 1] + lq[1:])
    elif m == "v-cache-shape":  # V's cache may have pages, heads and a head dim of its own, not a page size
        wrong = (num_pages, page * 2, h_kv, d) if layout == "NPHD" else (num_pages, h_kv, page * 2, d)
        v2 = randn(gen, *wrong, dtype=dtype)
    elif m == "cache-dtype":
        k2 = k_cache.to(torch.bfloat16 if dtype == torch.float16 else torch.float16)
    elif m == "layout-name":
        extra["kv_cache_layout"] = "HND"
    elif m in ("max-over", "max-zero", "max-bool"):
        value = {"max-over": capacity + 1, "max-zero": 0, "max-bool": True}[m]
        extra["paged_attention_max_seq_len_kv" if sdpa_form else "max_seq_len_kv"] = value
    elif m == "table-None":
        ptk = None
    elif m == "kv-heads":  # 3 heads whichever way the cache is read: never divides H_q in {1, 2, 4}
        k2 = v2 = randn(gen, num_pages, 3, 3, d, dtype=dtype)
    elif m == "table-float":
        ptk = pt_k.float()
    elif m == "q-thd":  # a ragged q over paged caches (chunked prefill) needs seq_len_q: left out here
        q2 = randn(gen, b * s_q, h_q, d, dtype=dtype)
        sq = None
    elif m == "table-meta":
        ptk = pt_k.to("meta")
    elif m == "table-nontensor":
        ptk = table_k.tolist()
    elif m == "cache-last-stride":
        k2 = randn(gen, *shape[:-1], 1, dtype=dtype).expand(*shape)
    if sdpa_form and "kv_cache_layout" in extra:
        extra.pop("kv_cache_layout")
        if m == "layout-name":
            extra["paged_attention_max_seq_len_kv"] = 0
            m = "max-zero"
    if page == 1 and h_kv == 1 and not sdpa_form and "kv_cache_layout" not in extra and k2 is k_cache:
        extra["kv_cache_layout"] = layout  # [N, 1, 1, D] caches are refused without it: keep that finding apart
    desc = f"paged malformed:{m} base=({base}) q={_kwdesc({'q': q2, 'k': k2, 'v': v2, 'table': ptk, 'seq_len_kv': skv, 'seq_len_q': sq})} extra={_kwdesc(extra)}"

    def call(case):
        with _graph(rng=rng) as g:
            record(g, q2, k2, v2, ptk, ptv, skv, sq, extra)
        args = [x for x in contract_inputs(q2, k2, v2, ptk, ptv, skv, sq) if isinstance(x, torch.Tensor)]
        return g(*args)

    case = _new_case(expect, f"paged/malformed/{m}", desc, call)
    case.names = arguments_for(m, PAGED_ARGUMENTS)
    return case


def _paged_by_name(g, q, k, v, pt_k, pt_v, seq_q, seq_kv) -> dict | None:
    """The run's inputs keyed by the names in g.inputs, where each name is recognisable."""
    roles = {
        "q": q,
        "k": k,
        "v": v,
        "seq_len_q": seq_q,
        "seq_len_kv": seq_kv,
        "page_table": pt_k,
        "page_table_k": pt_k,
        "paged_attention_k_table": pt_k,
        "page_table_v": pt_v if pt_v is not None else pt_k,
        "paged_attention_v_table": pt_v if pt_v is not None else pt_k,
    }
    out = {}
    for h in g.inputs:
        if h.name not in roles or roles[h.name] is None:
            return None
        out[h.name] = roles[h.name]
    return out


def _gather(cache: torch.Tensor, table: torch.Tensor, layout: str, s_kv: int) -> torch.Tensor:
    """Paged cache -> dense [B, H_kv, S_kv, D], written independently of the library."""
    b, n = table.shape
    seqs = []
    for bi in range(b):
        pages = []
        for j in range(n):
            page = cache[int(table[bi, j])]
            pages.append(page if layout == "NPHD" else page.transpose(0, 1))  # -> [P, H, D]
        tokens = torch.cat(pages)[:s_kv]  # [S, H, D]
        seqs.append(tokens.transpose(0, 1))
    return torch.stack(seqs)


# ---- op: cudnn_attn.sdpa (torch's signature) ----------------------------------------------------------


@dataclass
class FunctionalRequest:
    dtype: torch.dtype
    shape_q: tuple
    shape_k: tuple
    shape_v: tuple
    mask_kind: str | None = None  # bool | float | float-inf
    mask_shape: tuple | None = None
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    p: float = 0.0
    grad: str = "none"  # none | qkv | qkv+mask | no_grad | inference_mode
    layouts: tuple = ("BHSD", "BHSD", "BHSD")
    mask_dtype: torch.dtype | None = None

    def describe(self) -> str:
        parts = [
            str(self.dtype).removeprefix("torch."),
            f"q{list(self.shape_q)} k{list(self.shape_k)} v{list(self.shape_v)}",
            "layouts=" + ",".join(self.layouts),
        ]
        if self.mask_kind:
            parts.append(
                f"attn_mask={self.mask_kind}{list(self.mask_shape)}:{str(self.mask_dtype).removeprefix('torch.')}"
            )
        if self.is_causal:
            parts.append("is_causal")
        if self.scale is not None:
            parts.append(f"scale={self.scale}")
        if self.enable_gqa:
            parts.append("enable_gqa")
        if self.p:
            parts.append(f"dropout_p={self.p}")
        parts.append(f"grad={self.grad}")
        return " ".join(parts)


FUNCTIONAL_LAYOUTS = ("BHSD", "BHSD", "BSHD", "SBHD", "padded", "expanded", "last-stride")


def _functional_layout(x: torch.Tensor, layout: str, gen) -> torch.Tensor:
    if layout == "expanded":  # stride 0 on the head dim (any size-1 axis would do)
        if x.dim() == 4 and x.shape[1] > 1:
            return x[:, :1].expand_as(x)
        if x.dim() == 3 and x.shape[0] > 1:
            return x[:1].expand_as(x)
        return x
    if layout == "last-stride":  # the head dim not contiguous: torch's SDPA takes any strides
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout in ("BSHD", "SBHD") and x.dim() == 3:
        return to_layout(x, "BSHD")
    return to_layout(x, layout)


def _draw_functional(rng: random.Random) -> FunctionalRequest:
    dtype = pick(rng, IO_DTYPES)
    rank = rng.choice([4, 4, 4, 3])
    b = rng.choice([1, 2])
    h = rng.choice([1, 2, 3, 4])
    gqa = h > 1 and rng.random() < 0.3
    h_kv = rng.choice([x for x in (1, 2) if h % x == 0 and x < h]) if gqa else h
    ell, s = rng.randint(1, 12), rng.randint(1, 12)
    e = rng.choice([8, 16])
    ev = e if rng.random() < 0.8 else rng.choice([8, 16])
    req = FunctionalRequest(dtype, (b, h, ell, e), (b, h_kv, s, e), (b, h_kv, s, ev))
    req.enable_gqa = gqa or rng.random() < 0.1
    if rng.random() < 0.3:
        req.p = rng.choice([0.1, 0.3, 0.5])
        s = min(s, ev)
        req.shape_k, req.shape_v = (b, h_kv, s, e), (b, h_kv, s, ev)
        req.scale = 0.1
    r = rng.random()
    if r < 0.2:
        req.is_causal = True
    elif r < 0.6:
        req.mask_kind = rng.choice(["bool", "bool", "float", "float-inf"])
        req.mask_shape = rng.choice(
            [
                (ell, s),
                (s,),
                (1, s),
                (ell, 1),
                (b, 1, 1, s),
                (1, h, ell, s),
                (b, h, ell, s),
                (h, ell, s),
                (b, 1, ell, s),
                (1, 1, ell, s),
            ]
        )
        req.mask_dtype = torch.bool if req.mask_kind == "bool" else rng.choice([dtype, dtype, torch.float32])
    if req.scale is None and rng.random() < 0.3:
        req.scale = rng.choice([0.05, 0.3, 1.0, -0.5, 0.0])
    req.grad = rng.choice(["none", "qkv", "qkv", "qkv+mask", "no_grad", "inference_mode"])
    if req.grad == "qkv+mask" and req.mask_kind != "float":
        req.grad = "qkv"
    req.layouts = tuple(rng.choice(FUNCTIONAL_LAYOUTS) if rng.random() < 0.4 else "BHSD" for _ in range(3))
    if rank == 3:
        req.shape_q, req.shape_k, req.shape_v = req.shape_q[1:], req.shape_k[1:], req.shape_v[1:]
        if req.mask_shape is not None and len(req.mask_shape) == 4:
            req.mask_shape = req.mask_shape[1:]
    return req


def _functional_tensors(req: FunctionalRequest, gen):
    q = randn(gen, *req.shape_q, dtype=req.dtype)
    k = randn(gen, *req.shape_k, dtype=req.dtype)
    if req.p:
        lead = req.shape_v[:-2]
        v = orthonormal_rows(gen, math.prod(lead), 1, req.shape_v[-2], req.shape_v[-1], req.dtype).reshape(req.shape_v)
    else:
        v = randn(gen, *req.shape_v, dtype=req.dtype)
    q, k, v = (_functional_layout(x, lay, gen) for x, lay in zip((q, k, v), req.layouts))
    mask = None
    if req.mask_kind == "bool":
        mask = torch.rand(*req.mask_shape, generator=gen) > 0.3
    elif req.mask_kind:
        mask = torch.randn(*req.mask_shape, generator=gen).to(req.mask_dtype)
        if req.mask_kind == "float-inf":
            mask = mask.masked_fill(torch.rand(*req.mask_shape, generator=gen) < 0.3, float("-inf"))
    return q, k, v, mask


def sdpa64(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, keep=None, p=0.0):
    """torch's scaled_dot_product_attention, as documented, in float64 for any rank >= 2 (batch dims
    broadcast, bool masks select, float masks add, fully masked rows give 0). Returns (O, probs, allowed, bias)."""
    q, k, v = (x.double() for x in (q, k, v))
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * float(scale)
    allowed = torch.ones(s.shape, dtype=torch.bool)
    bias = None
    if is_causal:
        allowed &= torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if attn_mask is not None:
        m = attn_mask.expand(s.shape) if attn_mask.dim() <= s.dim() else attn_mask
        if m.dtype == torch.bool:
            allowed &= m
        else:
            allowed &= torch.isfinite(m) | (m > 0)
            bias = torch.where(torch.isfinite(m), m.double(), torch.zeros((), dtype=torch.float64))
    s = s + bias if bias is not None else s
    s = s.masked_fill(~allowed, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx))
    z = e.sum(-1, keepdim=True)
    probs = e / torch.where(z == 0, torch.ones_like(z), z)
    dropped = probs * keep / (1 - p) if keep is not None and p > 0 else probs
    return dropped @ v, probs, allowed, bias


def _functional_expected(req, q, k, v, mask, o_actual=None):
    """(O, allowed, bias, keep, scale, squeezed) in float64; with dropout the keep-mask is read from O."""
    squeeze = q.dim() == 3
    q4, k4, v4 = (x.unsqueeze(0) if squeeze else x for x in (q, k, v))
    scale = req.scale if req.scale is not None else 1 / math.sqrt(q4.shape[-1])
    o, probs, allowed, bias = sdpa64(q4, k4, v4, mask, req.is_causal, scale, enable_gqa=True)
    keep = None
    if req.p:
        o_act = as_tensor(o_actual).detach().double()
        o_act = o_act.unsqueeze(0) if squeeze else o_act
        assert not torch.isnan(o_act).any(), "O: NaN in result"
        keep, _ = infer_keep(o_act, v4, probs, req.p)
        check_dropout_rate(keep, probs, req.p)
        o, *_ = sdpa64(q4, k4, v4, mask, req.is_causal, scale, enable_gqa=True, keep=keep, p=req.p)
    return o, allowed, bias, keep, scale, squeeze


def _functional_probs(req, q, k, v, mask) -> torch.Tensor:
    q4, k4, v4 = (x.unsqueeze(0) if q.dim() == 3 else x for x in (q, k, v))
    scale = req.scale if req.scale is not None else 1 / math.sqrt(q4.shape[-1])
    return sdpa64(q4, k4, v4, mask, req.is_causal, scale, enable_gqa=True)[1]


def _reduce_to(x: torch.Tensor, shape) -> torch.Tensor:
    lead = x.dim() - len(shape)
    x = x.sum(dim=tuple(range(lead))) if lead > 0 else x
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(dim=dims, keepdim=True) if dims else x


def _functional_case(rng: random.Random, gen: torch.Generator) -> Case:
    req = _draw_functional(rng)
    r = rng.random()
    if r < 0.5:
        return _functional_valid(rng, gen, req)
    return _functional_malformed(rng, gen, req)


def _functional_kwargs(req: FunctionalRequest, mask) -> dict:
    kw = {}
    if mask is not None:
        kw["attn_mask"] = mask
    if req.is_causal:
        kw["is_causal"] = True
    if req.scale is not None:
        kw["scale"] = req.scale
    if req.enable_gqa:
        kw["enable_gqa"] = True
    if req.p:
        kw["dropout_p"] = req.p
    return kw


def _functional_valid(rng, gen, req: FunctionalRequest) -> Case:
    q, k, v, mask = _functional_tensors(req, gen)
    kw = _functional_kwargs(req, mask)
    d_o = randn(gen, *req.shape_q[:-1], req.shape_v[-1], dtype=req.dtype)
    state = {"fresh": None}
    repeat = req.p and rng.random() < 0.3
    global_seed = rng.getrandbits(32)

    def call(case):
        with torch.random.fork_rng(devices=[]):  # dropout seeds come from torch's generator: fixed per case
            torch.default_generator.manual_seed(global_seed)
            return _call(case)

    def _call(case):
        leaves = [x.detach().requires_grad_() if req.grad.startswith("qkv") else x for x in (q, k, v)]
        m = kw.get("attn_mask")
        if req.grad == "qkv+mask":
            m = m.detach().requires_grad_()
        args = dict(kw, attn_mask=m) if m is not None else kw
        if repeat:
            torch.default_generator.manual_seed(1234)
        if req.grad == "no_grad":
            with torch.no_grad():
                out = library(cudnn_attn.sdpa)(*leaves, **args)
        elif req.grad == "inference_mode":
            with torch.inference_mode():
                out = library(cudnn_attn.sdpa)(*leaves, **args)
        else:
            out = library(cudnn_attn.sdpa)(*leaves, **args)
        state["out"] = out
        if repeat:
            torch.default_generator.manual_seed(1234)
            with torch.no_grad():
                detached = {x: (y.detach() if isinstance(y, torch.Tensor) else y) for x, y in args.items()}
                state["again"] = library(cudnn_attn.sdpa)(*[x.detach() for x in leaves], **detached)
                state["fresh"] = library(cudnn_attn.sdpa)(*[x.detach() for x in leaves], **detached)
        if req.grad.startswith("qkv"):
            assert isinstance(out, torch.Tensor) and out.requires_grad, "output does not require grad"
            out.backward(d_o)
            state["grads"] = [x.grad for x in leaves] + ([m.grad] if req.grad == "qkv+mask" else [])
        return out

    def check(out):
        o_exp, allowed, bias, keep, scale, squeeze = _functional_expected(req, q, k, v, mask, out)
        expected = o_exp.squeeze(0) if squeeze else o_exp
        empty = empty_rows(allowed, o_exp.shape)
        assert_close(
            "O", out, expected, tol(req.dtype), req.dtype, empty.squeeze(0) if squeeze and empty is not None else empty
        )
        if repeat:
            assert torch.equal(state["again"], out.detach()), "same torch.manual_seed, different dropout"
            if state["fresh"] is not None and int((_functional_probs(req, q, k, v, mask) > 0.02).sum()) >= 80:
                assert not torch.equal(state["fresh"], out.detach()), (
                    "two calls without reseeding drew the same dropout mask"
                )
        if req.grad.startswith("qkv"):
            grads = state["grads"]
            q4, k4, v4 = (x.unsqueeze(0) if squeeze else x for x in (q, k, v))
            o4 = out.detach().unsqueeze(0) if squeeze else out.detach()
            do4 = d_o.unsqueeze(0) if squeeze else d_o
            e_q, e_k, e_v, d_s = grads64(
                q4, k4, v4, o4, do4, scale=scale, allowed=allowed, bias=bias, keep=keep, p=req.p
            )
            # torch's kernels (cudnn_attn.sdpa's CPU path) differentiate through their own O, not the
            # rounded one returned: the formula given the exact O, measured against the terms summed
            # (a row with one key has dQ = 0 exactly, which the rounded O's formula does not give).
            x_q, x_k, x_v, _ = grads64(
                q4, k4, v4, o_exp, do4, scale=scale, allowed=allowed, bias=bias, keep=keep, p=req.p
            )
            floors = gradient_floors(
                q4, k4, v4, o_exp, do4, scale=scale, allowed=allowed, bias=bias, keep=keep, p=req.p
            )
            for name, actual, e, x, floor in zip(
                ("dQ", "dK", "dV"), grads[:3], (e_q, e_k, e_v), (x_q, x_k, x_v), floors
            ):
                assert actual is not None, f"{name}: no gradient"
                try:
                    assert_close(name, actual, e.squeeze(0) if squeeze else e, tol(req.dtype), req.dtype)
                except AssertionError as given_o:
                    try:
                        assert_close(
                            name, actual, x.squeeze(0) if squeeze else x, tol(req.dtype), req.dtype, floor=floor
                        )
                    except AssertionError as exact_o:
                        raise AssertionError(
                            f"{given_o} (given the O returned); {exact_o} (given the exact O)"
                        ) from None
            if req.grad == "qkv+mask":  # the additive mask's gradient is dS, summed over its broadcast dims
                d_mask, scale_terms = _reduce_to(d_s, mask.shape), _reduce_to(d_s.abs(), mask.shape)
                assert grads[3] is not None, "attn_mask: no gradient"
                assert_close(
                    "d(attn_mask)", grads[3], d_mask, tol(req.dtype), mask.dtype, floor=float(scale_terms.norm())
                )

    label = (
        "+".join(
            x
            for x in (
                req.mask_kind and f"mask-{req.mask_kind}",
                "causal" if req.is_causal else "",
                "gqa" if req.shape_k[-3] != req.shape_q[-3] else "",
                "dropout" if req.p else "",
                f"rank{len(req.shape_q)}" if len(req.shape_q) != 4 else "",
                req.grad if req.grad != "none" else "",
                "expanded" if "expanded" in req.layouts else "",
                "last-stride" if "last-stride" in req.layouts else "",
            )
            if x
        )
        or "plain"
    )
    return _new_case(VALID, f"functional/valid/{label}", f"cudnn_attn.sdpa({req.describe()})", call, check)


def _functional_malformed(rng, gen, req: FunctionalRequest) -> Case:
    q, k, v, mask = _functional_tensors(req, gen)
    kw = _functional_kwargs(req, mask)
    args = [q, k, v]
    expect = MALFORMED
    dt = req.dtype
    other = torch.bfloat16 if dt == torch.float16 else torch.float16
    m = rng.choice(
        [
            "q-numpy",
            "k-numpy",
            "q-nontensor",
            "k-nontensor",
            "v-nontensor",
            "q-0d",
            "q-rank1",
            "k-meta",
            "v-meta",
            "mask-meta",
            "q-int",
            "q-bool",
            "q-complex",
            "k-dtype",
            "v-dtype",
            "e-mismatch",
            "s-mismatch",
            "batch-mismatch",
            "gqa-not-dividing",
            "heads-without-gqa",
            "mask-shape",
            "mask-int",
            "mask-rank5",
            "mask-numpy",
            "mask-list",
            "mask-and-causal",
            "scale-bad",
            "causal-bad",
            "dropout-bad",
            "gqa-flag-bad",
            "float32",
            "float64",
            "rank2",
            "rank5",
            "zero-size",
            "all-meta",
            "scale-bool",
            "dropout-bool",
            "causal-int",
            "batch-broadcast",
            "scale-tensor",
        ]
    )
    either = {
        "float32",
        "float64",
        "rank2",
        "rank5",
        "zero-size",
        "all-meta",
        "scale-bool",
        "dropout-bool",
        "causal-int",
        "batch-broadcast",
        "scale-tensor",
    }
    label = m
    if m in ("q-numpy", "k-numpy"):
        i = 0 if m == "q-numpy" else 1
        x = args[i].detach().contiguous()
        args[i] = x.numpy() if x.dtype == torch.float16 and rng.random() < 0.5 else x.float().numpy()
    elif m in ("q-nontensor", "k-nontensor", "v-nontensor"):
        name, value = pick(rng, NON_TENSORS)
        args["qkv".index(m[0])] = value
        label = f"{m}={name}"
    elif m == "q-0d":
        args[0] = torch.tensor(1.0, dtype=dt)
    elif m == "q-rank1":
        args[0] = randn(gen, req.shape_q[-1], dtype=dt)
    elif m in ("k-meta", "v-meta"):
        args["qkv".index(m[0])] = args["qkv".index(m[0])].to("meta")
    elif m == "mask-meta":
        kw.pop("is_causal", None)
        kw["attn_mask"] = torch.ones(req.shape_q[-2], req.shape_k[-2], dtype=torch.bool, device="meta")
    elif m in ("q-int", "q-bool", "q-complex"):
        dtype = {"q-int": torch.int32, "q-bool": torch.bool, "q-complex": torch.complex64}[m]
        args = [x.to(dtype) for x in args] if rng.random() < 0.5 else [args[0].to(dtype), k, v]
    elif m in ("k-dtype", "v-dtype"):
        args["qkv".index(m[0])] = args["qkv".index(m[0])].to(other)
    elif m == "e-mismatch":
        args[1] = randn(gen, *req.shape_k[:-1], 24 - req.shape_k[-1], dtype=dt)
    elif m == "s-mismatch":
        args[2] = randn(gen, *req.shape_v[:-2], req.shape_v[-2] + 1, req.shape_v[-1], dtype=dt)
    elif m == "batch-mismatch":
        if len(req.shape_q) == 3:  # a batch dim added to each, of sizes that do not broadcast
            # (inputs of other ranks broadcast, as torch's: a missing leading dim is 1)
            args[0] = randn(gen, 2, *req.shape_q, dtype=dt)
            args[1] = randn(gen, 3, *req.shape_k, dtype=dt)
            args[2] = randn(gen, 3, *req.shape_v, dtype=dt)
            kw.pop("attn_mask", None)
        else:  # batches that differ and do not broadcast (torch broadcasts a batch of 1)
            nq = max(req.shape_q[0], 2)
            args[0] = randn(gen, nq, *req.shape_q[1:], dtype=dt)
            nb = nq + 1
            args[1], args[2] = randn(gen, nb, *req.shape_k[1:], dtype=dt), randn(gen, nb, *req.shape_v[1:], dtype=dt)
            kw.pop("attn_mask", None)
    elif m == "gqa-not-dividing":
        hq = req.shape_q[-3]
        hk = 3 if hq % 3 else 5
        args[1] = randn(gen, *req.shape_k[:-3], hk, *req.shape_k[-2:], dtype=dt)
        args[2] = randn(gen, *req.shape_v[:-3], hk, *req.shape_v[-2:], dtype=dt)
        kw["enable_gqa"] = True
    elif m == "heads-without-gqa":  # head counts that differ and do not broadcast (torch broadcasts 1)
        hq = max(req.shape_q[-3], 2)
        args[0] = randn(gen, *req.shape_q[:-3], hq, *req.shape_q[-2:], dtype=dt)
        hk = hq + 1
        args[1] = randn(gen, *req.shape_k[:-3], hk, *req.shape_k[-2:], dtype=dt)
        args[2] = randn(gen, *req.shape_v[:-3], hk, *req.shape_v[-2:], dtype=dt)
        kw.pop("enable_gqa", None)
        kw.pop("attn_mask", None)
    elif m.startswith("mask-"):
        kw.pop("is_causal", None)
        ell, s = req.shape_q[-2], req.shape_k[-2]
        if m == "mask-shape":
            kw["attn_mask"] = torch.ones(ell + 1, s + 1, dtype=torch.bool)
        elif m == "mask-int":
            kw["attn_mask"] = torch.ones(ell, s, dtype=rng.choice([torch.int64, torch.int8, torch.uint8]))
        elif m == "mask-rank5":
            kw["attn_mask"] = torch.ones(2, 3, 1, ell, s, dtype=torch.bool)
        elif m == "mask-numpy":
            kw["attn_mask"] = np.ones((ell, s), dtype=bool)
        elif m == "mask-list":
            kw["attn_mask"] = [[True] * s] * ell
        elif m == "mask-and-causal":  # torch 2.13 applies both (issue 42): a valid request
            kw["attn_mask"], kw["is_causal"] = torch.rand(ell, s, generator=gen) > 0.3, True
            kw.pop("dropout_p", None)  # the check reads no keep-mask
            expect = VALID
    elif m == "scale-bad":
        # torch's SDPA takes any float scale (inf and NaN too) and True: refused here only what it refuses
        name, value = pick(rng, [x for x in BAD_SCALES if x[0] not in ("bool", "nan", "inf", "-inf")])
        kw["scale"] = value
        label = f"scale={name}"
    elif m == "causal-bad":
        kw.pop("attn_mask", None)
        name, value = pick(rng, [("str", "yes"), ("list", [True]), ("float", 0.5), ("tensor2", torch.ones(2))])
        kw["is_causal"] = value
        label = f"is_causal={name}"
    elif m == "dropout-bad":
        # dropout_p=1.0 torch takes (all dropped: zeros)
        name, value = pick(
            rng, [x for x in BAD_PROBS[:-2] if x[0] != "1.0"] + [("10**400", 10**400), ("tensor2", torch.ones(2))]
        )
        if name == "bool":
            name, value = "-1", -1
        kw["dropout_p"] = value
        label = f"dropout_p={name}"
    elif m == "gqa-flag-bad":
        kw["enable_gqa"] = rng.choice(["yes", [1]])
        label = "enable_gqa=non-bool"
    elif m in ("float32", "float64"):
        dtype = torch.float32 if m == "float32" else torch.float64
        args = [x.to(dtype) for x in args]
        if "attn_mask" in kw and kw["attn_mask"].dtype not in (torch.bool, torch.float32):
            kw["attn_mask"] = kw["attn_mask"].to(dtype)
    elif m == "rank2":
        args = [x.reshape(-1, x.shape[-2], x.shape[-1])[0] for x in args]
        kw.pop("attn_mask", None), kw.pop("enable_gqa", None)
    elif m == "rank5":
        args = [x.reshape(*([1] * (5 - x.dim())), *x.shape).expand(2, *([-1] * 4)).contiguous() for x in args]
        kw.pop("attn_mask", None)
    elif m == "zero-size":
        dim = rng.randrange(len(req.shape_q) - 1)
        shapes = [list(req.shape_q), list(req.shape_k), list(req.shape_v)]
        for sh in shapes:
            if dim != len(sh) - 2 or rng.random() < 0.5:
                sh[dim] = 0
        args = [randn(gen, *sh, dtype=dt) for sh in shapes]
        kw.pop("attn_mask", None)
        label = f"zero-size-dim{dim}"
    elif m == "all-meta":
        args = [x.to("meta") for x in args]
        kw.pop("attn_mask", None)
    elif m == "scale-bool":
        kw["scale"] = True
    elif m == "dropout-bool":
        kw["dropout_p"] = False
    elif m == "causal-int":
        kw.pop("attn_mask", None)
        kw["is_causal"] = 1
    elif m == "batch-broadcast":
        if len(req.shape_q) == 4 and req.shape_q[0] == 2:
            args[1], args[2] = args[1][:1], args[2][:1]
        else:
            args[0] = randn(gen, 2, *req.shape_q[-3:], dtype=dt)
            args[1], args[2] = args[1].reshape(-1, *req.shape_k[-3:])[:1], args[2].reshape(-1, *req.shape_v[-3:])[:1]
        kw.pop("attn_mask", None)
    elif m == "scale-tensor":
        kw["scale"] = torch.tensor(0.3)
    if m in either:
        expect = EITHER
    desc = f"cudnn_attn.sdpa {expect}:{label} base=({req.describe()}) args={_kwdesc(dict(enumerate(args)))} kwargs={_kwdesc(kw)}"

    global_seed = rng.getrandbits(32)

    def call(case):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(global_seed)
            return library(cudnn_attn.sdpa)(*args, **kw)

    def check(out):
        qa, ka, va = args
        if m == "all-meta":
            assert out.shape == (*qa.shape[:-1], va.shape[-1]), f"meta O shape {list(out.shape)}"
            return
        if m.startswith("zero-size") or label.startswith("zero-size"):
            assert tuple(out.shape) == (*qa.shape[:-1], va.shape[-1]), f"shape {list(out.shape)}"
            assert not torch.isnan(out).any(), "NaN"
            return
        if kw.get("dropout_p"):
            return
        ref, *_ = sdpa64(
            qa,
            ka,
            va,
            kw.get("attn_mask"),
            bool(kw.get("is_causal", False)),
            float(kw["scale"]) if kw.get("scale") is not None else None,
            bool(kw.get("enable_gqa", False)),
        )
        assert_close("O", out, ref, tol(qa.dtype), qa.dtype)

    case = _new_case(expect, f"functional/{expect}/{label}", desc, call, check if expect != MALFORMED else None)
    case.names = arguments_for(label, FUNCTIONAL_ARGUMENTS) if expect == MALFORMED else ()
    return case


# ---- op: FP8 (Graph.sdpa_fp8 and cudnn_attn.sdpa_fp8) -----------------------------------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_LARGEST = {E4M3: 448.0, E5M2: 57344.0}
# Relative error of FP8 attention against float64 attention of the same (dequantised) inputs: P
# and O are each rounded to 3 (E4M3) or 2 (E5M2) mantissa bits, about 3.6% and 7% rms; the worst of
# 2,000 seeds on the reference emulation, with small S (few terms to average the rounding) was
# below 60% of these. ``sdpa_fp8`` also rounds Q, K and V (E4M3).
FP8_TOL = {E4M3: 0.1, E5M2: 0.2}
FP8_FUNCTIONAL_TOL = 0.15  # measured: median 5%, worst 9% of 600 requests (five roundings, S down to 1)
# Stats: float32 math on exact (dequantised) inputs, but Hopper's FP8 tensor cores accumulate Q K^T
# with fewer bits than float32: up to 1.1e-4 measured at d = 128 on an H100 (the reference: 1e-7).
FP8_STATS_TOL = 1e-3
# backward="fp8": dO (E5M2), O, dS and the gradients rounded to FP8 as well; measured against the
# size of the terms summed (``gradient_floors``), since D = rowsum(dO * O) from FP8 values
# cancels against dP where P is nearly one-hot (the emulation shows the same): median 7%, worst 17%.
FP8_GRAD_TOL = 0.3
FP8_HEAD_DIMS = (16, 32, 64, 128)  # FP8 head dims are multiples of 16 (128 for the FP8 backward on Hopper)


def fp8_quantised(gen: torch.Generator, shape: tuple, dtype: torch.dtype, headroom: float = 1.0):
    """(raw FP8 tensor, float32 [1, 1, 1, 1] descale, float64 dequantised values): fresh normal
    values scaled so that the largest lands ``headroom`` below the format's largest, then rounded
    (torch's cast rounds to nearest even; nothing saturates)."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float32)
    amax = float(x.abs().max()) if x.numel() else 1.0
    scale = torch.tensor(FP8_LARGEST[dtype] * headroom / max(amax, 1e-30), dtype=torch.float32)
    raw = (x * scale).to(dtype)
    descale = (1.0 / scale).reshape(1, 1, 1, 1)
    return raw, descale, raw.double() * descale.double()


def gradient_floors(q, k, v, o, d_o, *, scale, allowed=None, bias=None, keep=None, p=0.0) -> tuple[float, float, float]:
    """Norms of the terms each gradient sums (|P| (|dP| + |D|) |K| for dQ, its transpose with |Q|
    for dK, |P|^T |dO| for dV; dropout's keep-mask and 1 / (1 - p) in P and dP), in float64: the
    scale a gradient's rounding error lives on where the terms cancel (FP8; a row with one key)."""
    q, k, v, o, d_o = (t.double() for t in (q, k, v, o, d_o))
    h_q, h_k = q.shape[-3], k.shape[-3]
    probs = probs64(q, k, scale=scale, allowed=allowed, bias=bias)
    factor = keep.double() / (1 - p) if keep is not None and p > 0 else 1.0
    k_full = k.repeat_interleave(h_q // h_k, dim=-3)
    v_full = v.repeat_interleave(h_q // v.shape[-3], dim=-3)
    terms = probs * ((d_o @ v_full.transpose(-1, -2)).abs() * factor + (d_o * o).sum(-1, keepdim=True).abs())
    d_q = (terms @ k_full.abs()) * abs(scale)
    d_k = _group_sum((terms.transpose(-1, -2) @ q.abs()) * abs(scale), h_k)
    d_v = _group_sum((probs * factor).transpose(-1, -2) @ d_o.abs(), v.shape[-3])
    return float(d_q.norm()), float(d_k.norm()), float(d_v.norm())


def dequantised(x: Any, descale: float) -> torch.Tensor:
    return as_tensor(x).detach().double() * descale


def _fp8_case(rng: random.Random, gen: torch.Generator) -> Case:
    if rng.random() < 0.5:
        return _fp8_graph_case(rng, gen)
    return _fp8_functional_case(rng, gen)


def _fp8_graph_case(rng: random.Random, gen: torch.Generator) -> Case:
    """``Graph.sdpa_fp8``: raw FP8 Q, K, V with their descales; O written in FP8 under scale_o."""
    fp8 = E4M3 if rng.random() < 0.85 else E5M2
    b, h_q = rng.choice([1, 1, 2]), rng.choice([1, 2, 4])
    h_kv = rng.choice([x for x in (1, 2, 4) if h_q % x == 0])
    s_q, s_kv = rng.randint(1, 64), rng.randint(1, 64)
    d = rng.choice(FP8_HEAD_DIMS)
    d_v = d if rng.random() < 0.9 else rng.choice(FP8_HEAD_DIMS)
    causal = "top_left" if rng.random() < 0.3 else None
    window = None
    if rng.random() < 0.12:
        s_q, s_kv = min(s_q, s_kv), max(s_q, s_kv)
        window = rng.randint(1, s_kv)
    lq = lkv = None
    hopper_refuses = rng.random() < 0.08  # valid, but not on Hopper's FP8 kernels: counted apart there
    if hopper_refuses:
        what = rng.choice(["bottom_right", "padding", "d8"])
        if what == "bottom_right":
            causal, window = "bottom_right", None
            s_q = min(s_q, s_kv)
        elif what == "padding":
            lq, lkv = [rng.randint(1, s_q) for _ in range(b)], [rng.randint(1, s_kv) for _ in range(b)]
            window = None
        else:
            d = d_v = 8
    scale = rng.choice([None, None, 0.05, 0.3, 1.0])
    attn_scale = scale if scale is not None else d**-0.5
    q8, dq, q64 = fp8_quantised(gen, (b, h_q, s_q, d), fp8)
    k8, dk, k64 = fp8_quantised(gen, (b, h_kv, s_kv, d), fp8)
    v8, dv, v64 = fp8_quantised(gen, (b, h_kv, s_kv, d_v), fp8)
    scale_s = torch.full((1, 1, 1, 1), FP8_LARGEST[fp8])
    descale_s = 1.0 / scale_s
    scale_o = (1.0 / dv) * rng.choice([1.0, 0.5])  # |O| <= max|V|: O never saturates
    scales = [dq, dk, dv, descale_s, scale_s, scale_o]
    kw: dict = {}
    if causal == "top_left":
        kw["use_causal_mask"] = True
    elif causal == "bottom_right":
        kw["use_causal_mask_bottom_right"] = True
    if window is not None:
        kw["sliding_window_length"] = window
    if scale is not None:
        kw["attn_scale"] = scale
    seq_q = seq_kv = None
    if lq is not None:
        seq_q, seq_kv = _int32(lq), _int32(lkv)
        kw.update(use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv)
    want_stats = rng.random() < 0.5
    kw["generate_stats"] = want_stats
    base = (
        f"g.sdpa_fp8 {str(fp8).removeprefix('torch.')} b{b} h{h_q}/{h_kv} s{s_q}x{s_kv} d{d}/{d_v} causal={causal} "
        f"window={window} seq_len_q={lq} seq_len_kv={lkv} attn_scale={scale} stats={want_stats} "
        f"scale_o=1/descale_v*{float(scale_o * dv):g}"
    )
    inputs = distinct([q8, k8, v8, *scales, seq_q, seq_kv])
    r = rng.random()
    if r < 0.55:
        use_out = rng.random() < 0.6
        o_geom = ((b, h_q, s_q, d_v), contiguous_stride((b, h_q, s_q, d_v)))

        def call(case):
            with _graph(rng=rng) as g:
                o, stats, amax_s, amax_o = g.sdpa_fp8(q8, k8, v8, *scales, **kw)
                if use_out:
                    o.set_dim(o_geom[0]).set_stride(o_geom[1])
            run_kw = {}
            if use_out:
                outs = [poisoned(*o_geom, fp8)]
                if want_stats:
                    outs.append(poisoned((b, h_q, s_q, 1), contiguous_stride((b, h_q, s_q, 1)), torch.float32))
                outs += [poisoned((1, 1, 1, 1), (1, 1, 1, 1), torch.float32) for _ in range(2)]
                run_kw["out"] = tuple(outs)
            return g(*inputs, **run_kw)

        def check(result):
            results = unpack_outputs(result, 4 if want_stats else 3)
            o, amax_s, amax_o = results[0], results[-2], results[-1]
            o64, lse = oracle.attention(
                q64, k64, v64, scale=attn_scale, causal=causal, window=window, seq_q=lq, seq_kv=lkv
            )
            allowed = scores_mask(b, h_q, s_q, s_kv, causal=causal, window=window, lq=lq, lkv=lkv)
            assert as_tensor(o).dtype == fp8, f"O: dtype {as_tensor(o).dtype}, expected {fp8} (q's)"
            assert_close(
                "O (dequantised)",
                dequantised(o, 1.0 / float(scale_o)),
                o64,
                FP8_TOL[fp8],
                rows_zero=empty_rows(allowed, o64.shape),
            )
            if want_stats:
                assert_close("Stats", results[1], lse, FP8_STATS_TOL, torch.float32)
            top = float(o64.abs().max())
            amax_o = float(as_tensor(amax_o).reshape(-1)[0])
            assert abs(amax_o - top) <= FP8_TOL[fp8] * top + 1e-6, f"Amax_O {amax_o:.4g}, max|O| {top:.4g}"
            probs = probs64(q64, k64, scale=attn_scale, allowed=allowed)
            amax_s = float(as_tensor(amax_s).reshape(-1)[0])
            assert 0.85 * float(probs.max()) <= amax_s <= 1 + 1e-6, (
                f"Amax_S {amax_s:.4g}; max P {float(probs.max()):.4g} (a softmax's max lies in (0, 1])"
            )

        features = (
            "+".join(
                x
                for x in (
                    causal or "",
                    "window" if window else "",
                    "padding" if lq else "",
                    "gqa" if h_kv != h_q else "",
                    "e5m2" if fp8 == E5M2 else "",
                    "d8" if d == 8 else "",
                )
                if x
            )
            or "plain"
        )
        return _new_case(VALID, f"fp8/graph/valid/{features}", base, call, check)
    if r < 0.7:
        outs_spec = [((b, h_q, s_q, d_v), contiguous_stride((b, h_q, s_q, d_v)), fp8)]
        label, args, run_kw = runtime_mutation(rng, gen, inputs, outs_spec)

        def call(case):
            with _graph(rng=rng) as g:
                o, _, _, _ = g.sdpa_fp8(q8, k8, v8, *scales, **kw)
                o.set_dim(outs_spec[0][0]).set_stride(outs_spec[0][1])
            name_run_inputs(case, g, inputs, args, label)
            if label.startswith("run:out-"):  # O, (Stats,) Amax_S, Amax_O: only O's buffer is wrong
                case.names = ()
            return g(*args, **run_kw)

        return _new_case(MALFORMED, f"fp8/graph/{label}", f"g(...) {label} on {base}", call)
    m = rng.choice(
        [
            "descale-f16",
            "descale-shape",
            "scale-None",
            "q-bf16",
            "qkv-bf16",
            "k-headdim",
            "kv-heads",
            "k-dtype",
            "stats-contradiction",
            "scale-nontensor",
            "descale-meta",
        ]
    )
    roles = {"q": q8, "k": k8, "v": v8}
    sc = list(scales)
    kw2 = dict(kw)
    names: tuple = ()
    if m == "descale-f16":
        sc[0] = dq.half()
        names = ("descale_q",)
    elif m == "descale-shape":
        sc[1] = dk.reshape(1)
        names = ("descale_k",)
    elif m == "scale-None":
        sc[5] = None
        names = ("scale_o",)
    elif m == "scale-nontensor":
        sc[4] = FP8_LARGEST[fp8]
        names = ("scale_s",)
    elif m == "descale-meta":
        sc[2] = dv.to("meta")
        names = ("descale_v",)
    elif m == "q-bf16":
        roles["q"] = q64.to(torch.bfloat16)
        names = ("q",)
    elif m == "qkv-bf16":
        roles = {r: x.to(torch.bfloat16) for r, x in (("q", q64), ("k", k64), ("v", v64))}
        names = ("q",)
    elif m == "k-headdim":
        roles["k"] = fp8_quantised(gen, (b, h_kv, s_kv, d + 16), fp8)[0]
        names = ("k",)
    elif m == "kv-heads":
        hk = 3
        roles["k"] = fp8_quantised(gen, (b, hk, s_kv, d), fp8)[0]
        roles["v"] = fp8_quantised(gen, (b, hk, s_kv, d_v), fp8)[0]
        names = ("k", "v")
    elif m == "k-dtype":
        roles["k"] = k64.to(torch.float16)
        names = ("k", "q")
    elif m == "stats-contradiction":
        kw2.update(is_inference=True, generate_stats=True)
        names = ("generate_stats", "is_inference")
    desc = f"g.sdpa_fp8 malformed:{m} base=({base}) q/k/v={_kwdesc(roles)} scales={_kwdesc(dict(enumerate(sc)))}"

    def call(case):
        with _graph(rng=rng) as g:
            g.sdpa_fp8(roles["q"], roles["k"], roles["v"], *sc, **kw2)
        args = [
            x for x in distinct([roles["q"], roles["k"], roles["v"], *sc, seq_q, seq_kv]) if isinstance(x, torch.Tensor)
        ]
        return g(*args)

    case = _new_case(MALFORMED, f"fp8/graph/malformed/{m}", desc, call)
    case.names = names
    return case


def _fp8_functional_case(rng: random.Random, gen: torch.Generator) -> Case:
    """``cudnn_attn.sdpa_fp8``: 16-bit in and out, the scaling done by the library."""
    dtype = pick(rng, IO_DTYPES)
    b, h = rng.choice([1, 2]), rng.choice([1, 2, 4])
    gqa = h > 1 and rng.random() < 0.3
    h_kv = rng.choice([x for x in (1, 2) if h % x == 0 and x < h]) if gqa else h
    ell, s = rng.randint(1, 48), rng.randint(1, 48)
    e = rng.choice(FP8_HEAD_DIMS)
    backward = rng.choice(["none", "none", "bf16", "bf16", "fp8"])
    if backward == "fp8" and rng.random() < 0.85:
        e = 128  # the FP8 backward on Hopper takes head dim 128 only
    delayed = backward == "fp8" or rng.random() < 0.4
    history = rng.choice([1, 4, 16])
    calls = 2 if delayed and rng.random() < 0.4 else 1  # the second call scales by the history
    is_causal = rng.random() < 0.3
    scale = rng.choice([None, None, 0.05, 0.3])
    rank = rng.choice([4, 4, 4, 3])
    shapes = [(b, h, ell, e), (b, h_kv, s, e), (b, h_kv, s, e)]
    if rank == 3:
        shapes = [x[1:] for x in shapes]
    q, k, v = (randn(gen, *shape, dtype=dtype) for shape in shapes)
    d_o = randn(gen, *shapes[0], dtype=dtype)
    kw: dict = {}
    if is_causal:
        kw["is_causal"] = True
    if scale is not None:
        kw["scale"] = scale
    if gqa or rng.random() < 0.1:
        kw["enable_gqa"] = True
    if backward != "none" and (backward == "fp8" or rng.random() < 0.5):
        kw["backward"] = backward
    base = (
        f"cudnn_attn.sdpa_fp8 {str(dtype).removeprefix('torch.')} q{list(q.shape)} k{list(k.shape)} "
        f"kwargs={_kwdesc(kw)} scaling={f'Fp8Scaling(history={history})' if delayed else None} "
        f"grad={backward} calls={calls}"
    )
    if rng.random() < 0.6:

        def call(case):
            scaling = cudnn_attn.Fp8Scaling(history) if delayed else None
            args = dict(kw, scaling=scaling) if delayed else kw
            outs, grads = [], []
            for _ in range(calls):  # a second call takes its scales from the history: the same values fit them
                leaves = [x.clone().requires_grad_(backward != "none") for x in (q, k, v)]
                out = library(cudnn_attn.sdpa_fp8)(*leaves, **args)
                outs.append(out)
                if backward != "none":
                    out.backward(d_o)
                    grads.append([x.grad for x in leaves])
            return outs, grads

        def check(result):
            outs, grads = result
            for i, out in enumerate(outs):
                qi, ki, vi = (x.double() for x in (q, k, v))
                o64, probs, allowed, _ = sdpa64(qi, ki, vi, None, is_causal, scale, enable_gqa=True)
                assert isinstance(out, torch.Tensor) and out.dtype == dtype, f"call {i}: {_describe_result(out)}"
                assert_close(f"O (call {i + 1})", out, o64, FP8_FUNCTIONAL_TOL, dtype)
                if backward == "none":
                    continue
                q4, k4, v4, o4, do4 = (x.unsqueeze(0) if rank == 3 else x for x in (qi, ki, vi, o64, d_o))
                expected = grads64(
                    q4,
                    k4,
                    v4,
                    o4,
                    do4,
                    scale=scale if scale is not None else e**-0.5,
                    allowed=allowed if rank == 4 else allowed.unsqueeze(0),
                )
                floors = (0.0, 0.0, 0.0)
                if backward == "fp8":
                    floors = gradient_floors(
                        q4,
                        k4,
                        v4,
                        o4,
                        do4,
                        scale=scale if scale is not None else e**-0.5,
                        allowed=allowed if rank == 4 else allowed.unsqueeze(0),
                    )
                for name, actual, exp, floor in zip(("dQ", "dK", "dV"), grads[i], expected[:3], floors):
                    assert actual is not None, f"{name}: no gradient"
                    exp = exp.squeeze(0) if rank == 3 else exp
                    # "bf16": the 16-bit attention's own gradients (its O rounded to the dtype)
                    limit = FP8_GRAD_TOL if backward == "fp8" else 2 * tol(dtype)
                    assert_close(f"{name} (call {i + 1}, backward={backward})", actual, exp, limit, dtype, floor=floor)

        label = (
            "+".join(
                x
                for x in (
                    "causal" if is_causal else "",
                    "gqa" if gqa else "",
                    f"rank{rank}" if rank == 3 else "",
                    "delayed" if delayed else "",
                    f"grad-{backward}" if backward != "none" else "",
                )
                if x
            )
            or "plain"
        )
        return _new_case(VALID, f"fp8/functional/valid/{label}", base, call, check)
    m = rng.choice(
        [
            "attn_mask",
            "backward-int8",
            "backward-fp8-no-scaling",
            "scaling-str",
            "query-fp8",
            "key-dtype",
            "heads-not-dividing",
            "headdim-mismatch",
            "scale-nan",
            "is_causal-str",
            "float32",
            "zero-size",
        ]
    )
    args, kw2, expect, names = [q, k, v], dict(kw), MALFORMED, ()
    kw2.pop("backward", None)
    if m == "attn_mask":
        kw2["attn_mask"] = torch.rand(ell, s, generator=gen) > 0.3
        names = ("attn_mask",)
    elif m == "backward-int8":
        kw2["backward"] = "int8"
        names = ("backward",)
    elif m == "backward-fp8-no-scaling":
        kw2["backward"] = "fp8"
        names = ("backward", "scaling")
    elif m == "scaling-str":
        kw2["scaling"] = "delayed"
        names = ("scaling",)
    elif m == "query-fp8":
        args[0] = q.to(E4M3)
        names = ("query",)
    elif m == "key-dtype":
        args[1] = k.to(torch.bfloat16 if dtype == torch.float16 else torch.float16)
        names = ("query", "key")
    elif m == "heads-not-dividing":
        args[1] = randn(gen, *shapes[1][:-3], 3, s, e, dtype=dtype)
        args[2] = randn(gen, *shapes[2][:-3], 3, s, e, dtype=dtype)
        kw2["enable_gqa"] = True
        names = ("query", "key", "value", "enable_gqa")
    elif m == "headdim-mismatch":
        args[1] = randn(gen, *shapes[1][:-1], e + 16, dtype=dtype)
        names = ("query", "key")
    elif m == "scale-nan":
        kw2["scale"] = float("nan")
        names = ("scale",)
    elif m == "is_causal-str":
        kw2["is_causal"] = "yes"
        names = ("is_causal",)
    elif m == "float32":  # torch's SDPA takes float32: refused, or FP8 attention with float32 in and out
        args = [x.float() for x in args]
        expect = EITHER
    elif m == "zero-size":
        args = [randn(gen, *shape[:-2], 0, shape[-1], dtype=dtype) for shape in shapes]
        expect = EITHER
    desc = f"cudnn_attn.sdpa_fp8 {expect}:{m} base=({base}) args={_kwdesc(dict(enumerate(args)))} kwargs={_kwdesc(kw2)}"

    def call(case):
        return library(cudnn_attn.sdpa_fp8)(*args, **kw2)

    def check(out):
        qa, ka, va = args
        assert tuple(as_tensor(out).shape) == (*qa.shape[:-1], va.shape[-1]), f"shape {_describe_result(out)}"
        if m == "zero-size":
            return
        o64, *_ = sdpa64(qa, ka, va, None, is_causal, kw2.get("scale"), enable_gqa=True)
        assert_close("O", out, o64, FP8_FUNCTIONAL_TOL, qa.dtype)

    case = _new_case(expect, f"fp8/functional/{expect}/{m}", desc, call, check if expect == EITHER else None)
    case.names = names
    return case


# ---- op: dropout, checked statistically -------------------------------------------------------------------
#
# cuDNN draws its keep-mask from its own Philox stream, so no mask can be compared with another
# backend's. What any correct dropout must do instead: drop about a fraction p of the weights
# (binomial bounds), scale the kept ones by exactly 1/(1 - p), draw independent masks for
# different heads, repeat the mask for the same seed and offset and change it for another seed
# or offset, give the backward the forward's mask, and keep O unbiased: its mean over many seeds
# is the output without dropout. With V's rows orthonormal, O = sum_j w_j v_j gives the weights
# w_j = P_j m_j / (1 - p) back exactly (``infer_keep``): the mask and its scale are read from O.

DROPOUT_PROBS = (0.1, 0.2, 0.3, 0.5, 0.7)
MEAN_RUNS = 64  # seeds averaged by the mean-over-seeds checks


def check_dropout_weights(o, v, probs, p: float, sure) -> torch.Tensor:
    """The keep-mask read back from O (orthonormal V), after checking the weights: each weight that
    can be told apart (``sure``) is either 0 or P/(1 - p) (the scale), and about a fraction p of
    them are 0 (within 5 sigma of the binomial count). Returns the mask."""
    keep, w = infer_keep(o, v, probs, p)
    ratio = (w * (1 - p) / probs.clamp_min(1e-30))[sure]
    kept = keep[sure]
    n = int(sure.sum())
    assert n > 0, "no identifiable weight: a bug of this fuzz file"
    if kept.any():
        scale = float(ratio[kept].mean())
        assert abs(scale - 1) < 0.02, (
            f"dropout p={p}: kept weights are scaled by {scale / (1 - p):.4g}, expected 1/(1-p) = {1 / (1 - p):.4g}"
        )
        worst = float((ratio[kept] - 1).abs().max())
        assert worst < 0.15, f"dropout p={p}: a kept weight is {worst:.3g} off P/(1-p)"
    if (~kept).any():
        worst = float(ratio[~kept].abs().max())
        assert worst < 0.15, f"dropout p={p}: a dropped weight is {worst:.3g} of P/(1-p), not 0"
    dropped = int((~kept).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(dropped - n * p) <= 5 * sigma + 1, (
        f"dropout p={p}: dropped {dropped} of {n} weights ({dropped / n:.3f}; expected {p} +- {5 * sigma / n:.3f})"
    )
    return keep


def check_masks_independent(keep, sure, minimum: int = 64) -> None:
    """Different (batch, head) pairs draw different masks (identical ones: a seed or offset that
    ignores the head or the batch). With >= 64 common identifiable weights, chance gives equal
    masks with probability below 1e-5."""
    b, h = keep.shape[:2]
    flat_keep, flat_sure = keep.reshape(b * h, -1), sure.expand_as(keep).reshape(b * h, -1)
    for i in range(b * h):
        for j in range(i + 1, b * h):
            both = flat_sure[i] & flat_sure[j]
            if int(both.sum()) >= minimum:
                same = torch.equal(flat_keep[i][both], flat_keep[j][both])
                assert not same, f"dropout: heads {divmod(i, h)} and {divmod(j, h)} (batch, head) drew the same mask"


def check_mean_over_seeds(
    outs: list[torch.Tensor], expected: torch.Tensor, p: float, rows: int, what: str, dtype: torch.dtype
) -> None:
    """The mean of ``outs`` (one per seed) against the no-dropout ``expected``: within the noise
    the runs' own spread predicts (chi-square-like bound, rows as the independent units), and
    the best-fit factor between them within 4 standard errors of 1 (a wrong scale or rate
    moves it by about p)."""
    runs = torch.stack([as_tensor(o).detach().double() for o in outs])
    assert not torch.isnan(runs).any(), f"{what}: NaN in a run"
    mean = runs.mean(0)
    se2 = runs.var(0, unbiased=True) / len(outs)  # squared standard error of each element's mean
    norm2 = float((expected**2).sum())
    if norm2 == 0:
        return
    noise2 = float(se2.sum()) / norm2
    err2 = float(((mean - expected) ** 2).sum()) / norm2
    bound = noise2 * (1 + 6 * math.sqrt(2 / max(rows, 1))) + tol(dtype) ** 2  # + the dtype's rounding
    factor = float((mean * expected).sum()) / norm2
    assert abs(factor - 1) <= 4 * math.sqrt(noise2) + tol(dtype), (
        f"{what}: the mean over {len(outs)} seeds is {factor:.4f} x the output without dropout "
        f"(noise {math.sqrt(noise2):.3g}; p={p}: a wrong scale or rate shows as a factor off 1)"
    )
    assert err2 <= bound, (
        f"{what}: the mean over {len(outs)} seeds is {math.sqrt(err2):.3g} (relative) from the output without "
        f"dropout; its spread predicts {math.sqrt(noise2):.3g} (bound {math.sqrt(bound):.3g}, p={p})"
    )


def _dropout_case(rng: random.Random, gen: torch.Generator) -> Case:
    r = rng.random()
    if r < 0.45:
        return _dropout_readback_case(rng, gen)
    if r < 0.65:
        return _dropout_mean_case(rng, gen)
    if r < 0.85:
        return _dropout_functional_mean_case(rng, gen)
    return _dropout_malformed_case(rng, gen)


def _dropout_readback_case(rng: random.Random, gen: torch.Generator) -> Case:
    """Graph.sdpa with dropout (and, half the time, its backward in the same graph): the mask
    read back from O, its rate and scale, its independence across heads, its repetition and
    change with the seed and offset, and the gradients given that mask."""
    dtype = pick(rng, IO_DTYPES)
    b, h_q = rng.choice([1, 2]), rng.choice([1, 2, 4])
    h_kv = rng.choice([x for x in (1, 2, 4) if h_q % x == 0])
    d_v = rng.choice([32, 64])
    d_qk = rng.choice([16, 32, 64])
    s_kv = rng.randint(8, d_v)  # V's rows orthonormal: S_kv <= d_v
    s_q = rng.randint(4, 40)
    p = rng.choice(DROPOUT_PROBS)
    causal = "top_left" if rng.random() < 0.25 else None
    lq = lkv = None
    if rng.random() < 0.2:
        lq = [rng.randint(1, s_q) for _ in range(b)]
        lkv = [rng.randint(1, s_kv) for _ in range(b)]
    scale = 0.1 / math.sqrt(d_qk)  # nearly uniform P: every weight can be told apart
    seed, offset = rng.randint(0, 2**31), rng.choice([0, rng.randint(1, 1000)])
    as_tensors = rng.random() < 0.7
    fused_backward = rng.random() < 0.5 and not (s_q == 1 and s_kv == 1)
    q = randn(gen, b, h_q, s_q, d_qk, dtype=dtype)
    k = randn(gen, b, h_kv, s_kv, d_qk, dtype=dtype)
    v = orthonormal_rows(gen, b, h_kv, s_kv, d_v, dtype)
    d_o = randn(gen, b, h_q, s_q, d_v, dtype=dtype)
    seed_t = torch.tensor([seed], dtype=torch.int64)
    offset_t = torch.tensor([offset], dtype=torch.int64)
    other_seed_t, other_offset_t = (
        torch.tensor([seed + 1], dtype=torch.int64),
        torch.tensor([offset + 4096], dtype=torch.int64),
    )
    kw: dict = {"attn_scale": scale, "generate_stats": True}
    if causal:
        kw["use_causal_mask"] = True
    seq_q = seq_kv = None
    if lq is not None:
        seq_q, seq_kv = _int32(lq), _int32(lkv)
        kw.update(use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv)
    if as_tensors:
        kw.update(dropout=p, dropout_seed=seed_t, dropout_offset=offset_t)
    else:
        kw.update(dropout=p, dropout_seed=seed, dropout_offset=offset)
    desc = (
        f"g.sdpa dropout={p} seed={seed} offset={offset} ({'tensors' if as_tensors else 'ints'}) "
        f"{str(dtype).removeprefix('torch.')} b{b} h{h_q}/{h_kv} s{s_q}x{s_kv} d{d_qk}/{d_v} causal={causal} "
        f"seq_len_q={lq} seq_len_kv={lkv} backward_in_the_graph={fused_backward}"
    )

    def call(case):
        with _graph(rng=rng) as g:
            o, stats = g.sdpa(q, k, v, **kw)
            if fused_backward:
                bw = {x: y for x, y in kw.items() if x != "generate_stats"}
                g.sdpa_backward(q, k, v, o, d_o, stats, **bw)
        runs = {}
        args = distinct(
            [q, k, v, seq_q, seq_kv] + ([seed_t, offset_t] if as_tensors else []) + ([d_o] if fused_backward else [])
        )
        runs["first"] = g(*args)
        runs["again"] = g(*args)
        if as_tensors:
            runs["other seed"] = g(*[other_seed_t if x is seed_t else x for x in args])
            runs["other offset"] = g(*[other_offset_t if x is offset_t else x for x in args])
        return runs

    def check(runs):
        count = 5 if fused_backward else 2
        first = unpack_outputs(runs["first"], count)
        again = unpack_outputs(runs["again"], count)
        for name, x, y in zip(("O", "Stats", "dQ", "dK", "dV"), first, again):
            assert torch.equal(as_tensor(x).nan_to_num(), as_tensor(y).nan_to_num()), (
                f"{name}: two runs with the same seed and offset differ"
            )
        o = as_tensor(first[0])
        assert not torch.isnan(o).any(), "O: NaN in result (unwritten or poisoned)"
        allowed = scores_mask(b, h_q, s_q, s_kv, causal=causal, lq=lq, lkv=lkv)
        probs = probs64(q, k, scale=scale, allowed=allowed)
        sure = probs > 0.25 / s_kv
        keep = check_dropout_weights(o, v, probs, p, sure)
        check_masks_independent(keep, sure)
        o_exp, lse = oracle.attention(q, k, v, scale=scale, causal=causal, seq_q=lq, seq_kv=lkv, keep=keep, p=p)
        assert_close("O", o, o_exp, tol(dtype), dtype, empty_rows(allowed, o_exp.shape))
        assert_close("Stats", first[1], lse, REFERENCE_TOL, torch.float32)
        for name in ("other seed", "other offset"):
            if name in runs and int(sure.sum()) >= 64:
                other = as_tensor(unpack_outputs(runs[name], count)[0])
                other_keep, _ = infer_keep(other, v, probs, p)
                assert not torch.equal(other_keep[sure.expand_as(keep)], keep[sure.expand_as(keep)]), (
                    f"dropout: the {name} drew the same mask"
                )
        if fused_backward:
            _check_grads(
                first[2:],
                Attn(dtype, b, h_q, h_kv, s_q, s_kv, d_qk, d_v, scale=scale, p=p),
                q,
                k,
                v,
                o,
                d_o,
                allowed,
                None,
                keep,
            )

    features = "+".join(
        x
        for x in (
            causal or "",
            "padding" if lq else "",
            "gqa" if h_kv != h_q else "",
            "backward" if fused_backward else "",
            "seed-tensors" if as_tensors else "",
        )
        if x
    )
    return _new_case(VALID, f"dropout/readback/valid/{features or 'plain'}", desc, call, check)


def _dropout_mean_case(rng: random.Random, gen: torch.Generator) -> Case:
    """One Graph.sdpa plan with seed and offset as tensors, run with MEAN_RUNS seeds: the mean of O
    is the output without dropout (dropout is unbiased only with the 1/(1 - p) scale)."""
    dtype = pick(rng, IO_DTYPES)
    h_q = rng.choice([1, 2, 4])
    h_kv = rng.choice([x for x in (1, 2, 4) if h_q % x == 0])
    s_q, s_kv = rng.randint(32 // h_q, 48), rng.randint(4, 64)
    d = rng.choice([16, 32, 64])
    p = rng.choice(DROPOUT_PROBS[:4])
    causal = rng.choice([None, None, "top_left"])  # bottom-right with dropout: refused by the contract
    q, k, v = (
        randn(gen, 1, h_q, s_q, d, dtype=dtype),
        randn(gen, 1, h_kv, s_kv, d, dtype=dtype),
        randn(gen, 1, h_kv, s_kv, d, dtype=dtype),
    )
    first_seed = rng.randint(0, 2**31)
    seeds = [torch.tensor([first_seed + i], dtype=torch.int64) for i in range(MEAN_RUNS)]
    offset = torch.tensor([rng.randint(0, 1000)], dtype=torch.int64)
    kw: dict = {"dropout": p, "dropout_seed": seeds[0], "dropout_offset": offset}
    if causal == "top_left":
        kw["use_causal_mask"] = True
    desc = (
        f"g.sdpa dropout={p} over {MEAN_RUNS} seeds from {first_seed} {str(dtype).removeprefix('torch.')} "
        f"b1 h{h_q}/{h_kv} s{s_q}x{s_kv} d{d} causal={causal}"
    )

    def call(case):
        with _graph(rng=rng) as g:
            g.sdpa(q, k, v, **kw)
        return [g(q, k, v, seed, offset) for seed in seeds]

    def check(outs):
        expected, _ = oracle.attention(q, k, v, scale=d**-0.5, causal=causal)
        check_mean_over_seeds(outs, expected, p, h_q * s_q, "O", dtype)

    return _new_case(VALID, f"dropout/mean/valid/{causal or 'plain'}", desc, call, check)


def _dropout_functional_mean_case(rng: random.Random, gen: torch.Generator) -> Case:
    """cudnn_attn.sdpa with dropout_p, MEAN_RUNS calls drawing their seeds from torch's generator:
    the mean of O is the output without dropout, and so is the mean of dV (the backward uses each
    call's own mask; dV = (P * mask / (1 - p))^T dO is unbiased)."""
    dtype = pick(rng, IO_DTYPES)
    h = rng.choice([1, 2, 4])
    ell, s, e = rng.randint(32 // h, 40), rng.randint(4, 48), rng.choice([16, 32, 64])
    p = rng.choice(DROPOUT_PROBS[:4])
    is_causal = rng.random() < 0.3
    grad = rng.random() < 0.5
    q, k, v = (randn(gen, 1, h, n, e, dtype=dtype) for n in (ell, s, s))
    d_o = randn(gen, 1, h, ell, e, dtype=dtype)
    torch_seed = rng.getrandbits(32)
    desc = (
        f"cudnn_attn.sdpa dropout_p={p} x{MEAN_RUNS} calls (torch seed {torch_seed}) {str(dtype).removeprefix('torch.')} "
        f"q{list(q.shape)} k{list(k.shape)} is_causal={is_causal} grad={grad}"
    )

    def call(case):
        outs, d_vs = [], []
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(torch_seed)
            for _ in range(MEAN_RUNS):
                leaves = [x.detach().requires_grad_(grad) for x in (q, k, v)]
                out = library(cudnn_attn.sdpa)(*leaves, dropout_p=p, is_causal=is_causal)
                if grad:
                    out.backward(d_o)
                    d_vs.append(leaves[2].grad)
                outs.append(out.detach())
        return outs, d_vs

    def check(result):
        outs, d_vs = result
        expected, probs, allowed, _ = sdpa64(q, k, v, None, is_causal)
        check_mean_over_seeds(outs, expected, p, h * ell, "O", dtype)
        assert not all(torch.equal(outs[0], o) for o in outs[1:]), "every call drew the same dropout mask"
        if grad:
            d_v = probs.transpose(-1, -2) @ d_o.double()
            check_mean_over_seeds(d_vs, d_v, p, h * s, "dV", dtype)

    return _new_case(
        VALID,
        f"dropout/functional-mean/valid/{'causal' if is_causal else 'plain'}{'+grad' if grad else ''}",
        desc,
        call,
        check,
    )


def _dropout_malformed_case(rng: random.Random, gen: torch.Generator) -> Case:
    dtype = pick(rng, IO_DTYPES)
    q, k, v = (randn(gen, 1, 2, 8, 16, dtype=dtype) for _ in range(3))
    m = rng.choice(["p-bad", "seed-float", "seed-shape", "offset-str", "tuple2", "p-bad-functional", "seed-without-p"])
    names: tuple = ("dropout", "dropout_seed", "dropout_offset")
    kw: dict = {}
    if m == "p-bad":
        name, value = pick(rng, BAD_PROBS)
        kw.update(dropout=value, dropout_seed=1, dropout_offset=0)
        m = f"dropout={name}"
    elif m == "seed-float":
        kw.update(dropout=0.2, dropout_seed=torch.tensor([1.0]), dropout_offset=torch.tensor([0]))
    elif m == "seed-shape":
        kw.update(dropout=0.2, dropout_seed=torch.tensor([1, 2]), dropout_offset=torch.tensor([0]))
    elif m == "offset-str":
        kw.update(dropout=0.2, dropout_seed=1, dropout_offset="0")
    elif m == "tuple2":
        kw["dropout"] = (0.2, torch.tensor([1]))
    elif m == "seed-without-p":
        kw.update(dropout_seed=torch.tensor([1.5]))
    elif m == "p-bad-functional":
        name, value = pick(rng, [x for x in BAD_PROBS if x[0] != "bool"])
        m = f"dropout_p={name}"
        names = ("dropout_p",)
    desc = f"dropout malformed:{m} {str(dtype).removeprefix('torch.')} q{list(q.shape)} kwargs={_kwdesc(kw)}"

    def call(case):
        if m.startswith("dropout_p="):
            return library(cudnn_attn.sdpa)(q, k, v, dropout_p=value)
        with _graph(rng=rng) as g:
            g.sdpa(q, k, v, **kw)
        extra = [x for x in (kw.get("dropout_seed"), kw.get("dropout_offset")) if isinstance(x, torch.Tensor)]
        return g(q, k, v, *extra)

    expect = EITHER if m == "seed-without-p" else MALFORMED  # a seed without dropout: ignored, or refused
    case = _new_case(expect, f"dropout/malformed/{m}", desc, call)
    case.names = names if expect == MALFORMED else ()
    return case


MAKERS.update(
    sdpa=_sdpa_case,
    sdpa_thd=_thd_case,
    sdpa_backward=_backward_case,
    paged=_paged_case,
    functional=_functional_case,
    fp8=_fp8_case,
    dropout=_dropout_case,
)


# ---- command line ----------------------------------------------------------------------------------------


def summarize(findings: list[Finding]) -> str:
    by_key: dict[str, list[Finding]] = {}
    for f in findings:
        by_key.setdefault(f.key, []).append(f)
    lines = []
    for key, group in sorted(by_key.items()):
        seeds = [f.seed for f in group]
        lines.append(f"[{len(group)}x] {key}: seeds {seeds[:12]}{' ...' if len(seeds) > 12 else ''}")
        lines.append("    " + group[0].line())
    return "\n".join(lines)


# ---- the GPU campaign: sizes, counts, refusals probed ---------------------------------------------------

# Requests per op: the normal GPU suite (``-m gpu``) and the full run (``-m "gpu and slow"``). The
# full run's seeds start at FULL_FIRST_SEED, so the two never repeat a request.
GPU_CAMPAIGN = {
    "normal": {
        "sdpa": 50,
        "sdpa_thd": 25,
        "sdpa_backward": 40,
        "paged": 35,
        "functional": 45,
        "fp8": 30,
        "dropout": 25,
    },
    "full": {
        "sdpa": 400,
        "sdpa_thd": 200,
        "sdpa_backward": 350,
        "paged": 300,
        "functional": 350,
        "fp8": 250,
        "dropout": 150,
    },
}
FULL_FIRST_SEED = 10_000


def campaign_seeds(size: str, op: str) -> range:
    first = FULL_FIRST_SEED if size == "full" else 0
    return range(first, first + GPU_CAMPAIGN[size][op])


def finding_class(f: Finding) -> str:
    """The four the targets count: wrong results, non-library exceptions, hangs, valid requests
    refused (on the GPU: refused with another error than UnsupportedError); the rest is "other"."""
    if f.kind == "wrong result" or f.kind.startswith("unusable result") or f.kind == "result on the wrong device":
        return "wrong"
    if f.kind.startswith("raised "):
        return "non-library exception"
    if f.kind == "timeout":
        return "hang"
    if f.kind.startswith("valid request refused"):
        return "valid refused"
    return "other"


class Tally:
    """A campaign's requests counted by what happened to them, for the summary and the docs."""

    def __init__(self) -> None:
        self.by_op: dict[str, int] = {}
        self.op_seconds: dict[str, float] = {}
        self.valid: dict[str, int] = {"ran and matched": 0, "unsupported": 0, "finding": 0}
        self.malformed: dict[str, int] = {}  # error class -> refused correctly
        self.malformed_findings = 0
        self.either: dict[str, int] = {"ran and matched": 0, "refused": 0, "finding": 0}
        self.unsupported: list[tuple[str, int, str]] = []  # (op, seed, first reason)
        self.findings: list[Finding] = []
        self.seconds = 0.0

    def add(self, case: Case, findings: list[Finding], seconds: float = 0.0) -> None:
        self.by_op[case.op] = self.by_op.get(case.op, 0) + 1
        self.op_seconds[case.op] = self.op_seconds.get(case.op, 0.0) + seconds
        self.findings += findings
        self.seconds += seconds
        if case.expect == VALID:
            key = "finding" if findings else ("unsupported" if case.outcome == "unsupported" else "ran and matched")
            self.valid[key] += 1
            if case.outcome == "unsupported":
                self.unsupported.append((case.op, case.seed, case.refusal))
        elif case.expect == MALFORMED:
            if findings:
                self.malformed_findings += 1
            else:
                error = case.outcome.removeprefix("refused: ")
                self.malformed[error] = self.malformed.get(error, 0) + 1
        else:
            self.either["finding" if findings else ("ran and matched" if case.outcome == "ran" else "refused")] += 1

    def merge(self, other: Tally) -> None:
        for op, n in other.by_op.items():
            self.by_op[op] = self.by_op.get(op, 0) + n
            self.op_seconds[op] = self.op_seconds.get(op, 0.0) + other.op_seconds.get(op, 0.0)
        for mine, theirs in ((self.valid, other.valid), (self.either, other.either), (self.malformed, other.malformed)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        self.malformed_findings += other.malformed_findings
        self.unsupported += other.unsupported
        self.findings += other.findings
        self.seconds += other.seconds

    @property
    def requests(self) -> int:
        return sum(self.by_op.values())

    def finding_counts(self) -> dict[str, int]:
        counts = {"wrong": 0, "non-library exception": 0, "hang": 0, "valid refused": 0, "other": 0}
        for f in self.findings:
            counts[finding_class(f)] += 1
        return counts

    def unsupported_reasons(self) -> dict[str, int]:
        reasons: dict[str, int] = {}
        for _, _, reason in self.unsupported:
            key = re.sub(r"-?\d+(\.\d+)?", "N", reason.split(": ", 1)[-1] if " on NVIDIA" in reason else reason)[:160]
            reasons[key] = reasons.get(key, 0) + 1
        return reasons

    def line(self, where: str = "") -> str:
        v, e = self.valid, self.either
        refused = ", ".join(f"{n} {k}" for k, n in sorted(self.malformed.items(), key=lambda x: -x[1]))
        found = self.finding_counts()
        return (
            f"fuzz campaign{' on ' + where if where else ''}: {self.requests} requests in {self.seconds:.0f} s | "
            f"valid {sum(v.values())}: {v['ran and matched']} ran and matched, {v['unsupported']} refused as "
            f"unsupported (UnsupportedError naming why) | malformed {sum(self.malformed.values()) + self.malformed_findings}: "
            f"{sum(self.malformed.values())} refused correctly ({refused}) | either {sum(e.values())}: "
            f"{e['ran and matched']} ran and matched, {e['refused']} refused | findings {len(self.findings)}: "
            + ", ".join(f"{n} {k}" for k, n in found.items())
        )

    def report(self, where: str = "") -> str:
        lines = [
            self.line(where),
            "requests by op: "
            + ", ".join(f"{op} {n} ({self.op_seconds.get(op, 0):.0f} s)" for op, n in self.by_op.items()),
        ]
        if self.unsupported:
            lines.append(f"valid requests refused as unsupported ({len(self.unsupported)}), by reason:")
            lines += [
                f"  [{n}x] {reason}" for reason, n in sorted(self.unsupported_reasons().items(), key=lambda x: -x[1])
            ]
            lines.append(
                "  (op seed: "
                + ", ".join(f"{op} {seed}" for op, seed, _ in self.unsupported[:40])
                + (" ..." if len(self.unsupported) > 40 else "")
                + ")"
            )
        if self.findings:
            lines.append(summarize(self.findings))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "by_op": self.by_op,
            "op_seconds": {k: round(v, 1) for k, v in self.op_seconds.items()},
            "seconds": round(self.seconds, 1),
            "valid": self.valid,
            "malformed_refused": self.malformed,
            "malformed_findings": self.malformed_findings,
            "either": self.either,
            "unsupported": [list(u) for u in self.unsupported],
            "unsupported_reasons": self.unsupported_reasons(),
            "findings": self.finding_counts(),
            "finding_lines": [f.line() for f in self.findings],
        }


def run_tallied(op: str, seeds, target: str, tally: Tally, progress=None) -> list[Finding]:
    """Run ``op``'s ``seeds`` on ``target`` in order (they share plan caches), counting into ``tally``."""
    import time

    findings: list[Finding] = []
    for seed in seeds:
        if progress is not None:
            progress(op, seed)
        start = time.perf_counter()
        case = make_case(op, seed, target)
        found = run_case(case)
        tally.add(case, found, time.perf_counter() - start)
        findings += found
    return findings


def _campaign_chunk(task: tuple[str, int, int, str]) -> Tally:
    op, first, stop, target = task
    tally = Tally()
    run_tallied(op, range(first, stop), target, tally)
    return tally


def run_campaign(size: str, target: str, workers: int = 1, chunk: int = 50, progress=None) -> Tally:
    """Every request of the ``size`` campaign on ``target``, in chunks of ``chunk`` seeds (each in
    order, as the test items run them); with ``workers`` > 1 the chunks run in that many processes
    sharing the GPU (cuDNN builds plans on the CPU: the campaign is mostly build time)."""
    tasks = [
        (op, first, min(first + chunk, seeds.stop), target)
        for op in GPU_CAMPAIGN[size]
        for seeds in [campaign_seeds(size, op)]
        for first in range(seeds.start, seeds.stop, chunk)
    ]
    tally = Tally()
    if workers <= 1:
        parts = map(_campaign_chunk, tasks)
    else:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(workers)
        parts = pool.imap(_campaign_chunk, tasks)
    for task, part in zip(tasks, parts):
        tally.merge(part)
        if progress is not None:
            progress(task, part, tally)
    if workers > 1:
        pool.close()
        pool.join()
    return tally


def device_description() -> str:
    """The GPU, cuDNN and frontend versions (or "cpu")."""
    if not torch.cuda.is_available():
        return "cpu"
    from cudnn_attn.ops.cudnn import platform as cudnn_platform

    try:
        return cudnn_platform.platform(torch.cuda.current_device()).describe()
    except Exception:  # noqa: BLE001 - the cuDNN library may be missing: name the GPU alone
        return torch.cuda.get_device_name()


# A valid request the GPU refused: re-run with the library's cuDNN rules off (those guarding a
# hang stay on), in a child process (a crash or a hang there cannot take the campaign with it).
PROBE_VERDICTS = {
    "runs": "cuDNN runs it and the result matches: the refusal is a defect",
    "guarded": "cuDNN got this one right, but its rule guards a shape-dependent wrong result (NaN or wrong values)",
    "wrong": "cuDNN runs it but the result is wrong: the refusal guards a cuDNN bug",
    "cudnn-refuses": "cuDNN itself refuses it (no plan builds)",
    "library-refuses": "refused again with the rules off (elsewhere in the library)",
    "not-probed": "not probed: its rule guards a hang",
    "crashed": "the probe crashed or hung",
}


@contextlib.contextmanager
def cudnn_rules_off():
    """The cuDNN backend asks no capability rule but those that guard a hang."""
    from cudnn_attn.ops.cudnn import capabilities

    original = capabilities.unsupported_reasons

    def hang_rules_only(problem, platform):
        return [r for r in original(problem, platform) if "hang" in r]

    capabilities.unsupported_reasons = hang_rules_only
    try:
        yield
    finally:
        capabilities.unsupported_reasons = original


CUDNN_OWN_REFUSAL = "cuDNN could not build a plan"  # the library's words for cuDNN's own refusal


def guards_wrong_results(refusal: str) -> bool:
    """Whether a capability rule's words say it guards a wrong result, rather than a missing feature."""
    return any(word in refusal for word in ("NaN", "wrong"))


def probe(op: str, seed: int, refusal: str = "") -> dict:
    """Run (op, seed) on the GPU with the library's cuDNN rules off: which ``PROBE_VERDICTS`` it is."""
    with cudnn_rules_off():
        case = make_case(op, seed, "cuda")
        findings = run_case(case)
    if case.outcome == "ran" and not findings:
        # A rule that guards wrong results refuses a class of shapes, some of which cuDNN gets right.
        verdict, detail = ("guarded" if guards_wrong_results(refusal) else "runs"), refusal
    elif case.outcome == "unsupported":
        hang = "hang" in case.refusal
        verdict = (
            "not-probed" if hang else ("cudnn-refuses" if CUDNN_OWN_REFUSAL in case.refusal else "library-refuses")
        )
        detail = case.refusal
    else:
        verdict, detail = "wrong", "; ".join(f"{f.kind}: {f.detail}" for f in findings)[:300] or case.outcome
    return {"op": op, "seed": seed, "verdict": verdict, "detail": detail, "refusal": refusal}


def probe_refusals(refused: list[tuple[str, int, str]], per_probe_s: float = 120.0) -> list[dict]:
    """Judge each valid request refused as unsupported ((op, seed, first reason)): cuDNN's own
    refusals as they are; the library's rules by ``probe`` in child processes (a child that dies
    or hangs is recorded against the probe it was running, and the rest go on in a new one)."""
    results: list[dict] = []
    todo = []
    for op, seed, reason in refused:
        if CUDNN_OWN_REFUSAL in reason:
            results.append({"op": op, "seed": seed, "verdict": "cudnn-refuses", "detail": reason, "refusal": reason})
        else:
            todo.append((op, seed, reason))
    while todo:
        command = [sys.executable, str(Path(__file__).resolve()), "--gpu", "--probe"]
        command += [f"{op}:{seed}:{reason}" for op, seed, reason in todo]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30 + per_probe_s * len(todo))
            out, tail = done.stdout, (done.stderr or "").strip()
        except subprocess.TimeoutExpired as error:
            out = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
            tail = "timed out"
        got = [json.loads(line[len("PROBE ") :]) for line in out.splitlines() if line.startswith("PROBE ")]
        results += got
        todo = todo[len(got) :]
        if todo:
            op, seed, reason = todo.pop(0)
            last = tail.splitlines()[-1] if tail else "no output"
            results.append({"op": op, "seed": seed, "verdict": "crashed", "detail": last, "refusal": reason})
    return results


def probe_report(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"  {r['op']} {r['seed']}: {PROBE_VERDICTS.get(r['verdict'], r['verdict'])} | {r.get('detail')}")
    return "\n".join(lines)


def refusal_rule(reason: str) -> str:
    """The rule (or cuDNN's own refusal) a refusal came from, numbers and context blanked."""
    if CUDNN_OWN_REFUSAL in reason:  # cuDNN's words, cut where the first line's clipping may fall
        rest = reason.split(CUDNN_OWN_REFUSAL, 1)[1].split("(the backend declined:")[-1].strip(" :")
        return f"{CUDNN_OWN_REFUSAL}: {rest[:40]}"
    reason = re.sub(r"^graph: (\d+ reasons: \| - )?(\w+: )?", "", reason).split(" | what would work")[0]
    return re.sub(r"-?\d+(\.\d+)?", "N", reason)[:140]


def probes_by_rule(results: list[dict]) -> str:
    """Per refusing rule: how many of its requests cuDNN refused, ran wrong, ran right."""
    table: dict[str, dict[str, int]] = {}
    for r in results:
        row = table.setdefault(refusal_rule(r.get("refusal") or r.get("detail") or ""), {})
        row[r["verdict"]] = row.get(r["verdict"], 0) + 1
    lines = []
    for rule, row in sorted(table.items(), key=lambda x: -sum(x[1].values())):
        lines.append(f"  [{sum(row.values())}x] {rule}: " + ", ".join(f"{v} {n}" for v, n in sorted(row.items())))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import collections
    import time

    target = "cpu"
    if argv and argv[0] in ("--gpu", "--harness"):
        target = "cuda" if argv[0] == "--gpu" else "cpu-harness"
        argv = argv[1:]
    if argv and argv[0] == "--probe":
        for item in argv[1:]:
            op, seed, reason = item.split(":", 2)
            print("PROBE " + json.dumps(probe(op, int(seed), reason)), flush=True)
        return 0
    if argv and argv[0] == "--summary" and target != "cpu":
        size = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else "full"  # normal | full
        workers = int(argv[argv.index("--workers") + 1]) if "--workers" in argv else 1
        start = time.perf_counter()

        def progress(task, part, tally):  # one line per chunk; the counts so far, should the run be cut short
            print(
                f"{task[0]} {task[1]}-{task[2] - 1}: {len(part.findings)} findings ({tally.requests} requests, "
                f"{time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            if os.environ.get("FUZZ_SUMMARY_JSON"):
                Path(os.environ["FUZZ_SUMMARY_JSON"]).write_text(json.dumps(tally.as_dict(), indent=1))

        tally = run_campaign(size, target, workers, progress=progress)
        where = f"{device_description() if target == 'cuda' else 'cpu (the harness)'}, {size} run"
        print(tally.report(where))
        print(f"wall time {time.perf_counter() - start:.0f} s with {workers} worker process(es)")
        probes = None
        if target == "cuda" and tally.unsupported:
            probes = probe_refusals(tally.unsupported)
            print("valid requests refused as unsupported, judged (cuDNN's own refusals; the library's rules probed):")
            print(probe_report(probes))
            counts = collections.Counter(r["verdict"] for r in probes)
            print("verdicts: " + ", ".join(f"{n} {PROBE_VERDICTS.get(v, v)}" for v, n in counts.most_common()))
            print("by rule (verdicts: " + ", ".join(f"{v} = {t}" for v, t in PROBE_VERDICTS.items()) + "):")
            print(probes_by_rule(probes))
        if os.environ.get("FUZZ_SUMMARY_JSON"):
            summary = dict(
                tally.as_dict(),
                device=device_description(),
                probes=probes,
                workers=workers,
                wall_s=round(time.perf_counter() - start, 1),
            )
            Path(os.environ["FUZZ_SUMMARY_JSON"]).write_text(json.dumps(summary, indent=1))
        return 0
    if argv and argv[0] == "--summary":
        counts: dict = collections.Counter()
        either: dict = collections.defaultdict(collections.Counter)
        findings: list[Finding] = []
        start = time.perf_counter()
        for op, chunks in OPS.items():
            for seed in range(chunks * CHUNK):
                case, found = run_seed(op, seed)
                counts[(op, case.expect)] += 1
                if case.expect == EITHER:
                    either[case.label][case.outcome if not found else "finding"] += 1
                findings += found
        print(f"{sum(counts.values())} cases in {time.perf_counter() - start:.1f} s")
        for (op, expect), n in sorted(counts.items()):
            print(f"  {op:14s} {expect:10s} {n}")
        print("requests the contract leaves open (either), and what the library did:")
        for label, outcomes in sorted(either.items()):
            print(f"  {label}: {dict(outcomes)}")
        print(f"{len(findings)} findings in {len({f.key for f in findings})} classes")
        print(summarize(findings))
        return 0
    op, seeds = argv[0], argv[1]  # one seed, or a range "first-last" (cases share the plan caches)
    first, _, last = seeds.partition("-")
    for seed in range(int(first), int(last or first) + 1):
        case = make_case(op, seed, target)
        found = run_case(case)
        if found or not last:
            print(f"{op} seed {seed}: {case.expect} [{case.label}] {case.outcome}\n  {case.desc}")
            if case.refusal:
                print(f"  refused as unsupported: {case.refusal}")
        for f in found:
            print("  FINDING " + f.kind + ": " + f.detail)
        if not found and not last:
            print("  ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
