"""The cuDNN frontend's module-level spellings (``cudnn_attn.heur_mode``, ``create_handle``, ...),
so drop-in code (``import cudnn_attn as cudnn``) runs unchanged.

Enums: ``heur_mode``, ``diagonal_alignment``, ``attention_implementation``,
``build_plan_policy``, ``cuda_graph_retention`` and ``scalar_type`` carry the frontend's member
names. They are this library's own classes, as ``data_type`` is (it maps to torch dtypes, which
the frontend's cannot), so the package imports and runs without the frontend; every keyword that
takes one matches members by ``.name``, so the frontend's own members
(``cudnn.diagonal_alignment.BOTTOM_RIGHT``) are accepted beside ours.
``heur_mode`` and ``build_plan_policy`` are accepted and need not change: the library asks cuDNN
for mode A with FALLBACK behind it and builds the plan the heuristics choose.

Handles: the library makes and reuses its own lazily (one per device and thread), so passing one
is optional everywhere. A handle made here holds the stream set on it (``set_stream``), as the
frontend's ``cudnn.Handle`` does; the frontend's handles are accepted by every function here.

Versions: ``backend_version()`` is the cuDNN library's version as the frontend loaded it.
"""

from __future__ import annotations

import enum
import functools
import pkgutil
from typing import Any

from ..errors import UnsupportedError


# Our own enums with the frontend's member names (why: the module docstring); keywords read any
# member by its ``.name``, so the frontend's members work wherever ours do.
class heur_mode(enum.Enum):  # noqa: N801 - the frontend's spelling
    """The frontend's heuristic modes, accepted wherever the frontend takes them (``build``,
    ``jit``, ``create_execution_plans``); plans are chosen with mode A, FALLBACK behind it.

    Example:
        ```python
        import cudnn_attn as cudnn

        modes = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
        ```
    """

    A = "A"
    B = "B"
    FALLBACK = "FALLBACK"
    OPENSOURCE = "OPENSOURCE"


class diagonal_alignment(enum.Enum):  # noqa: N801 - the frontend's spelling
    """Where a diagonal band's diagonal starts: row 0 at key 0 (``TOP_LEFT``), or the last row at
    the last key (``BOTTOM_RIGHT``); ``Graph.sdpa(diagonal_alignment=...)``.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        q, kv = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 16, 64)
        with cudnn.Graph() as g:  # the 4 queries are the last 4 of 16 positions, causal
            g.sdpa(q, kv, kv, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                   diagonal_band_right_bound=0)
        out = g(q, kv)  # k and v are one tensor: one input
        ```
    """

    TOP_LEFT = "TOP_LEFT"
    BOTTOM_RIGHT = "BOTTOM_RIGHT"


class attention_implementation(enum.Enum):  # noqa: N801 - the frontend's spelling
    """The frontend's engine families (``sdpa(implementation=...)``), accepted; cuDNN's
    heuristics choose the engine.

    Example:
        ```python
        import cudnn_attn as cudnn

        choice = cudnn.attention_implementation.AUTO
        ```
    """

    AUTO = "AUTO"
    COMPOSITE = "COMPOSITE"
    UNIFIED = "UNIFIED"


class build_plan_policy(enum.Enum):  # noqa: N801 - the frontend's spelling
    """The frontend's ``build_plans(policy)``: ``HEURISTICS_CHOICE`` builds the chosen plan,
    ``ALL`` lets ``execute_plan_at_index`` run any candidate (each built when first run).

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
        g = cudnn.pygraph()
        Q = g.tensor_like(q)
        O, _ = g.sdpa(Q, Q, Q)
        g.build_plans(cudnn.build_plan_policy.ALL)
        print(g.get_execution_plan_count())
        ```
    """

    HEURISTICS_CHOICE = "HEURISTICS_CHOICE"
    ALL = "ALL"


class cuda_graph_retention(enum.Enum):  # noqa: N801 - the frontend's spelling
    """The frontend's CUDA-graph retention choices (``pygraph(cuda_graph_retention=...)``).

    Both are accepted: what a graph keeps for CUDA-graph replays is the library's own business here.

    Example:
        ```python
        import cudnn_attn as cudnn

        g = cudnn.pygraph(cuda_graph_retention=cudnn.cuda_graph_retention.PER_GRAPH)
        ```
    """

    NONE = "NONE"
    PER_GRAPH = "PER_GRAPH"


class scalar_type(enum.Enum):  # noqa: N801 - the frontend's spelling
    """The frontend's kinds of score-modifier scalar (``graph.tensor_scalar(value, scalar_type)``).

    Both are accepted: either way the value is part of the plan's key here.

    Example:
        ```python
        import cudnn_attn as cudnn

        def halved(graph, scores):
            return graph.mul(a=scores, b=graph.tensor_scalar(0.5, cudnn.scalar_type.COMPILE_TIME_CONST))
        ```
    """

    COMPILE_TIME_CONST = "COMPILE_TIME_CONST"
    RUNTIME_PARAM = "RUNTIME_PARAM"


class Handle:
    """A library handle: binds work to a device and a stream (the frontend's ``cudnn.Handle``).

    Optional everywhere: one per device and thread is made when none is passed. The cuDNN
    backend attaches its cuDNN handle (``native``) on first use on a GPU. ``stream`` is the raw
    CUDA stream set by ``set_stream``; None (the default, unlike the frontend's stream 0) runs
    on torch's current stream at each call. ``cudnn_attn.handle`` is the same class.

    Args:
        device: the device (the current one by default).
        stream: a raw ``cudaStream_t`` int, a torch stream, or None.

    Example:
        ```python
        import cudnn_attn as cudnn

        handle = cudnn.create_handle()
        assert isinstance(handle, cudnn.Handle) and cudnn.get_stream(handle) is None
        ```
    """

    def __init__(self, device: Any = None, stream: Any = None):
        self.device = device
        self.stream: int | None = _stream_pointer(stream)
        self.native: Any = None  # the cuDNN handle, made on first use on a GPU

    def __repr__(self) -> str:
        stream = "" if self.stream is None else f" stream=0x{self.stream:x}"
        return f"<cudnn_attn.Handle device={self.device}{stream}>"


# The frontend's alias for its handle type, used in annotations.
handle = Handle


def create_handle(device: Any = None) -> Handle:
    """A handle for ``device`` (the current one by default); no GPU work until it is used.

    Args:
        device: the device, or None.

    Returns:
        A ``Handle``.

    Example:
        ```python
        import cudnn_attn as cudnn

        handle = cudnn.create_handle()
        cudnn.destroy_handle(handle)
        ```
    """
    return Handle(device)


def destroy_handle(handle: Any) -> None:
    """Release ``handle``'s cuDNN handle and forget its stream, as the frontend's does.

    A later use makes a fresh cuDNN handle. Takes this library's handles and the frontend's.

    Args:
        handle: the handle.

    Raises:
        TypeError: ``handle`` is neither this library's nor the frontend's.

    Example:
        ```python
        import cudnn_attn as cudnn

        cudnn.destroy_handle(cudnn.create_handle())
        ```
    """
    if isinstance(handle, Handle):
        native, handle.native, handle.stream = handle.native, None, None
        frontend = _frontend_handle_type()
        if frontend is not None and isinstance(native, frontend):
            _frontend().destroy_handle(native)
        return
    _frontend_call("destroy_handle", handle)(handle)


def set_stream(handle: Any, stream: Any) -> None:
    """Run ``handle``'s work on ``stream``.

    Args:
        handle: this library's handle or the frontend's.
        stream: a raw ``cudaStream_t`` as an int (the frontend's spelling), a torch stream, or
            None for torch's current stream at each call.

    Raises:
        TypeError: a stream of another kind, or a negative pointer; or not a handle.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        handle = cudnn.create_handle()
        if torch.cuda.is_available():
            cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        cudnn.set_stream(handle, None)  # back to torch's current stream
        ```
    """
    if isinstance(handle, Handle):
        handle.stream = _stream_pointer(stream)
        return
    _frontend_call("set_stream", handle)(handle, _stream_pointer(stream))


def get_stream(handle: Any) -> int | None:
    """The stream ``set_stream`` gave ``handle``.

    Args:
        handle: this library's handle or the frontend's.

    Returns:
        The raw stream pointer, or None (torch's current stream at each call).

    Example:
        ```python
        import cudnn_attn as cudnn

        assert cudnn.get_stream(cudnn.create_handle()) is None
        ```
    """
    if isinstance(handle, Handle):
        return handle.stream
    return _frontend_call("get_stream", handle)(handle)


def backend_version() -> int:
    """The cuDNN library's version as an int (9.19.0 is ``91900``), as the frontend reports it.

    The version of a cuDNN that torch links is not reported in its place: the cuDNN backend
    runs through the frontend, so only the library the frontend loaded can run a plan.

    Returns:
        The version.

    Raises:
        UnsupportedError: the frontend does not import or has no cuDNN library loaded (a
            ``RuntimeError``, as the frontend's own failure is); CPU tensors still run, on the
            reference backend.

    Example:
        ```python
        import cudnn_attn as cudnn

        try:
            print(cudnn.backend_version())
        except cudnn.UnsupportedError as error:  # no cuDNN here
            print(error.alternatives)
        ```
    """
    return int(_frontend_version_call("backend_version"))


def backend_version_string() -> str:
    """The cuDNN library's version as text (``"9.19.0"``).

    Returns:
        The version.

    Raises:
        UnsupportedError: as ``backend_version``.

    Example:
        ```python
        import cudnn_attn as cudnn

        try:
            print(cudnn.backend_version_string())
        except cudnn.UnsupportedError:
            print("no cuDNN library loaded")
        ```
    """
    return str(_frontend_version_call("backend_version_string"))


def get_last_error_string() -> str:
    """cuDNN's message for its last failed call in this thread.

    This library's own errors carry their reasons; this is for frontend code that asks.

    Returns:
        The message; empty where no cuDNN library is loaded (no cuDNN call can have failed).

    Example:
        ```python
        import cudnn_attn as cudnn

        print(repr(cudnn.get_last_error_string()))
        ```
    """
    try:
        return str(_frontend().get_last_error_string())
    except Exception:
        return ""


def _stream_pointer(stream: Any) -> int | None:
    """A stream as the raw pointer the frontend takes: an int as given, a torch stream's
    ``cuda_stream``; None stays None. ``TypeError`` for anything else, as the frontend's binding."""
    if stream is None:
        return None
    pointer = getattr(stream, "cuda_stream", stream)
    if isinstance(pointer, bool) or not isinstance(pointer, int):
        raise TypeError(
            f"stream: {type(stream).__name__}; expected a raw CUDA stream (an int, e.g. "
            "torch.cuda.current_stream().cuda_stream), a torch stream, or None"
        )
    if pointer < 0:
        raise TypeError(f"stream: {pointer}; a raw CUDA stream is a pointer (>= 0)")
    return pointer


def _frontend() -> Any:
    import cudnn

    return cudnn


def _frontend_handle_type() -> type | None:
    try:
        found = _frontend().Handle
    except Exception:  # no frontend: no frontend handle can exist
        return None
    return found if isinstance(found, type) else None


def _frontend_call(name: str, handle: Any) -> Any:
    """The frontend's ``name`` for one of its own handles; ``TypeError`` (the frontend's) for
    anything that is neither its handle nor ours."""
    frontend = _frontend_handle_type()
    if frontend is None or not isinstance(handle, frontend):
        raise TypeError(
            f"cudnn_attn.{name} expects a handle from cudnn_attn.create_handle() (or the frontend's "
            f"cudnn.create_handle()), got {type(handle).__name__}"
        )
    return getattr(_frontend(), name)


def _frontend_version_call(name: str) -> Any:
    try:
        frontend = _frontend()
    except Exception as error:
        raise UnsupportedError(
            [f"nvidia-cudnn-frontend: cannot be imported ({type(error).__name__}: {error})"],
            context=name,
            alternatives=[
                "pip install nvidia-cudnn-frontend",
                "CPU tensors need no cuDNN: the reference backend runs them",
            ],
        ) from error
    try:
        return getattr(frontend, name)()
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsupportedError(
            [f"cuDNN library: not loaded by nvidia-cudnn-frontend {frontend.__version__} ({first})"],
            context=name,
            alternatives=[
                "install cuDNN 9 where the frontend finds it (the nvidia-cudnn-cu12 or -cu13 wheel, or "
                "libcudnn.so.9 on LD_LIBRARY_PATH)",
                "CPU tensors need no cuDNN: the reference backend runs them",
            ],
        ) from error


@functools.cache
def frontend_names() -> frozenset[str]:
    """The frontend's public module-level names: its ``__all__``, its submodules and packages,
    and the functions it binds (some only where its build has them). Read without importing any
    of its optional packages; empty where the frontend does not import."""
    try:
        frontend = _frontend()
    except Exception:
        return frozenset()
    names = set(getattr(frontend, "__all__", ()))
    names |= {module.name for module in pkgutil.iter_modules(getattr(frontend, "__path__", []))}
    for name, value in vars(frontend).items():  # its own objects, not the modules it imports (os, sys)
        if str(getattr(value, "__module__", "")).split(".")[0] == frontend.__name__:
            names.add(name)
    return frozenset(name for name in names if not name.startswith("_"))
