"""The cuDNN frontend's build steps, plan helpers and ``execute``, for code written against
``cudnn.pygraph``; and its ``jit`` and ``graph_cache`` decorators.

The frontend builds in steps (validate, build the operation graph, create and check plans,
build plans); here all of them amount to one ``build()``, so frontend code runs unchanged.
Its plan helpers (``get_execution_plan_count``, ``execute_plan_at_index``, ...) address the
candidate plans of a one-node graph, in cuDNN's ranking; the reference backend has one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from ..runtime import interop, lifecycle
from ..runtime.runner import Runner
from . import serialized
from .declared import resolve
from .handles import InputHandle
from .node import Node
from .overrides import check_overridden, overridden_runner

RETENTION = ("PER_GRAPH", "NONE")


# pygraph's own parameters at their defaults, in its order (sm_count ... is_cuda_graph_replay_expected).
FRONTEND_DEFAULTS = (None, None, None, None, False, False, None, False)


def frontend_options(
    sm_count: Any,
    sm_version: Any,
    kernel_cache: Any,
    device_property: Any,
    is_dynamic_shape_enabled: Any,
    is_override_shape_enabled: Any,
    cuda_graph_retention: Any,
    is_cuda_graph_replay_expected: Any,
    /,
    **unknown: Any,
) -> list[str]:
    """The problems with ``pygraph``'s own parameters, one line each. What they mean here:
    ``sm_count`` and ``sm_version`` are recorded on the graph (plans are built for, and use the
    whole of, the GPU that runs them); ``kernel_cache`` is accepted (the plan cache and store keep
    built plans); the shape flags and the CUDA-graph hints are accepted (a packed plan serves
    every token count; captured runs replay as built). ``device_property`` asks for deviceless
    compilation, which is refused: plans are built on the GPU that runs them."""
    if device_property is not None:
        raise UnsupportedError(["device_property: deviceless (ahead-of-time) compilation is not available here; "
                                "plans are built on the GPU that runs them"], context="Graph")  # fmt: skip
    problems = [f"{name}: not a parameter of pygraph" for name in unknown]
    for name, value in (("sm_count", sm_count), ("sm_version", sm_version)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"{name}: {value!r}; expected an int >= 1 or None")
    for name, flag in (("is_dynamic_shape_enabled", is_dynamic_shape_enabled),
                       ("is_override_shape_enabled", is_override_shape_enabled),
                       ("is_cuda_graph_replay_expected", is_cuda_graph_replay_expected)):  # fmt: skip
        if not isinstance(flag, bool):
            problems.append(f"{name}: {flag!r}; expected True or False")
    retention = getattr(cuda_graph_retention, "name", cuda_graph_retention)
    if retention is not None and retention not in RETENTION:
        problems.append(f"cuda_graph_retention: {cuda_graph_retention!r}; allowed None, PER_GRAPH or NONE")
    return problems


def frontend_tensor_options(is_virtual: Any, reordering_type: Any, multiplier: Any) -> list[str]:
    """Why a ``tensor(...)`` of the frontend cannot be taken here, one line per reason (none: taken)."""
    reasons = []
    if is_virtual:
        reasons.append("is_virtual: virtual tensors connect the frontend's non-attention ops, which cudnn_attn does "
                       "not provide (use cudnn for such graphs)")  # fmt: skip
    if multiplier != 1:
        reasons.append(f"ragged_offset_multiplier: {multiplier!r}; ragged offsets are taken in elements (multiplier 1): "
                       "multiply the offsets tensor instead")  # fmt: skip
    if reordering_type is not None and getattr(reordering_type, "name", reordering_type) != "NONE":
        reasons.append(f"reordering_type: {reordering_type!r}; block-scaled (MXFP8) layouts are not supported")
    return reasons


HEURISTIC_MODES = ("A", "B", "FALLBACK", "OPENSOURCE")


def heuristics_problems(modes: Any, argument: str = "heuristics") -> list[str]:
    """Why ``modes`` (a heur_mode, or a list of them, ours or the frontend's) is not a list of heuristic modes."""
    given = modes if isinstance(modes, (list, tuple)) else [modes]
    bad = [m for m in given if getattr(m, "name", m) not in HEURISTIC_MODES]
    return [f"{argument}: {m!r}; expected heur_mode members ({', '.join(HEURISTIC_MODES)})" for m in bad]


def graph_cache(key_fn: Callable[..., Any], maxsize: int = 256) -> Callable:
    """The frontend's memo decorator: a function's result kept by a key of its arguments.

    The wrapped function's result is kept under ``key_fn(*args, **kwargs)``, the oldest entry
    dropped past ``maxsize``. The plan cache behind every graph makes it optional here: a graph
    rebuilt per call is a plan-cache hit.

    Args:
        key_fn: maps the wrapped function's arguments to a hashable key.
        maxsize: entries kept at most.

    Returns:
        A decorator.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        @cudnn.graph_cache(key_fn=lambda q: (tuple(q.shape), q.dtype))
        def attention_graph(q):
            with cudnn.Graph() as g:
                g.sdpa(q, q, q, use_causal_mask=True)
            return g

        q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
        assert attention_graph(q) is attention_graph(q.clone())
        ```
    """

    def decorator(func: Callable) -> Callable:
        cache: dict[Any, Any] = {}

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = key_fn(*args, **kwargs)
            if key in cache:
                return cache[key]
            result = func(*args, **kwargs)
            if len(cache) >= maxsize:
                cache.pop(next(iter(cache)))
            cache[key] = result
            return result

        return wrapper

    return decorator


def jit(heur_modes: Any = "A", **kwargs: Any) -> Callable:
    """The frontend's build decorator: builds the graph a function returns.

    The wrapped function returns ``(graph, tensors)``; the graph is built
    (``build(heur_modes)``) unless it has plans already, and ``(graph, uids)`` is returned, the
    uids of ``tensors`` in order (keys of ``execute``'s variant pack).

    Args:
        heur_modes: a ``heur_mode`` or a list of them, accepted (cuDNN mode A, FALLBACK behind).
        **kwargs: the frontend's other options, accepted.

    Returns:
        A decorator.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        @cudnn.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        def attention_graph(q):
            with cudnn.graph(None) as (g, _):
                Q = g.tensor_like(q)
                O, _ = g.sdpa(Q, Q, Q, use_causal_mask=True)
                O.set_output(True).set_dim(q.shape).set_stride(q.stride())
            return g, [Q, O]

        q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
        g, (q_uid, o_uid) = attention_graph(q)
        o = torch.empty_like(q)
        g.execute({q_uid: q, o_uid: o})
        ```
    """
    modes = heur_modes if isinstance(heur_modes, list) else [heur_modes]

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            graph, tensors = func(*args, **kwargs)
            if graph.get_execution_plan_count() <= 0:
                graph.build(modes)
            return graph, [t.get_uid() for t in tensors]

        return wrapper

    return decorator


class FrontendSteps:
    """Mixed into ``Graph``: the frontend's build steps, plan helpers and ``execute``."""

    _runner: Runner | None

    def build(self) -> Any:
        raise NotImplementedError

    def validate(self) -> Any:
        """The frontend's first build step: builds the graph (all steps are one ``build()`` here)."""
        return self.build()

    def build_operation_graph(self) -> Any:
        """The frontend's second build step: builds the graph."""
        return self.build()

    def create_execution_plans(self, *heuristics: Any) -> Any:
        """The frontend's plan step: the modes are checked, the graph built (mode A, FALLBACK behind)."""
        problems = [p for modes in heuristics for p in heuristics_problems(modes)]
        if problems:
            raise ValidationError(problems, context=self.name)  # type: ignore[attr-defined]
        return self.build()

    def check_support(self, *args: Any) -> Any:
        """The frontend's support check: builds the graph (``UnsupportedError`` lists the reasons)."""
        return self.build()

    def build_plans(self, *args: Any, **kwargs: Any) -> Any:
        """The frontend's last build step: builds; with ``build_plan_policy.ALL`` each candidate plan is
        built when first run by index."""
        policies = [*args, *kwargs.values()]
        bad = [p for p in policies if getattr(p, "name", p) not in ("HEURISTICS_CHOICE", "ALL")]
        if bad or set(kwargs) - {"policy"}:
            raise ValidationError([f"policy: {p!r}; expected build_plan_policy.HEURISTICS_CHOICE or ALL" for p in bad]
                                  + [f"{k}: not a parameter of build_plans" for k in set(kwargs) - {"policy"}],
                                  context=self.name)  # type: ignore[attr-defined]  # fmt: skip
        return self.build()

    def get_workspace_size(self, handle: Any = None, override_uids: Any = None, override_shapes: Any = None,
                           override_strides: Any = None) -> int:  # fmt: skip
        """The largest workspace, in bytes, of the graph's plans (allocated when ``execute`` gets none)."""
        self.build()
        return max((getattr(node.plan, "workspace_size", 0) for node in self.nodes), default=0)  # type: ignore[attr-defined]

    def serialize(self, *, as_bytes: bool = False, include_kernels: bool = True) -> Any:
        """The built graph as bytes ``deserialize`` reads back (``serialized.py``); a list of byte
        values unless ``as_bytes``, as the frontend returns. ``include_kernels`` is accepted."""
        data = serialized.serialize(self)
        return data if as_bytes else list(data)

    def deserialize(self, *args: Any, **kwargs: Any) -> None:
        """``deserialize(data)`` or ``deserialize(handle, data, enforce_precompiled=False)``, into
        an empty graph: it is built from what ``serialize`` wrote, with nothing planned again."""
        kwargs.pop("enforce_precompiled", None)
        handle = kwargs.pop("handle", kwargs.pop("handle_", None))
        data = kwargs.pop("data", None)
        if kwargs or len(args) > 3:
            raise ValidationError(
                [f"{k}: not a parameter of deserialize" for k in kwargs] or ["deserialize: too many arguments"]
            )
        if data is None:
            if len(args) == 1:
                (data,) = args
            elif args:
                handle, data = args[0], args[1]
        if handle is not None and self.handle is None:  # type: ignore[has-type]
            self.handle = handle
        self._runner = serialized.deserialize(self, data)
        lifecycle.track_releasable(self)

    # ---- plan helpers: the candidate plans of a one-node graph ------------------------------

    def get_execution_plan_count(self) -> int:
        """How many candidate plans the graph has: 0 until it is built."""
        if not self.recording.built:  # type: ignore[attr-defined]
            return 0
        return min(_plan_count(node) for node in self.nodes)  # type: ignore[attr-defined]

    def get_plan_name_at_index(self, index: int) -> str:
        """The engine name of candidate plan ``index`` of a one-node graph."""
        return _single(self, "get_plan_name_at_index").plan.plan_name_at(_index(self, index))  # type: ignore[union-attr]

    def get_workspace_size_plan_at_index(self, index: int, handle: Any = None, override_uids: Any = None,
                                         override_shapes: Any = None, override_strides: Any = None) -> int:  # fmt: skip
        """The workspace, in bytes, of candidate plan ``index`` of a one-node graph."""
        return _single(self, "get_workspace_size_plan_at_index").plan.at_index(_index(self, index)).workspace_size  # type: ignore[union-attr]

    def execute_plan_at_index(self, variant_pack: Mapping[Any, Any], workspace: Any = None, index: int = 0,
                              handle: Any = None, *, tensor_uids: Any = None) -> None:  # fmt: skip
        """``execute`` with candidate plan ``index`` (built on first use) instead of the chosen one."""
        node = _single(self, "execute_plan_at_index")
        runners = self.__dict__.setdefault("_indexed_runners", {})
        index = _index(self, index)
        if index not in runners:
            indexed = dataclasses.replace(node, plan=node.plan.at_index(index))  # type: ignore[union-attr]
            runners[index] = Runner(self.name, self.recording.inputs, [indexed], self.handle)  # type: ignore[attr-defined]
        inputs, outputs = self._variant_pack(variant_pack, {})
        runner = runners[index]
        runner.bind_out(values := runner.bind((inputs,))[0], outputs)
        runner.run(values, handle, None, workspace)

    def execute(self, variant_pack: Mapping[Any, Any], workspace: Any = None, handle: Any = None,
                override_uids: Any = None, override_shapes: Any = None, override_strides: Any = None, *,
                tensor_uids: Any = None, stream: Any = None) -> None:  # fmt: skip
        """The frontend's run: every tensor of the graph, inputs and outputs, given in one dict.

        Args:
            variant_pack: every input and every produced output of the graph, keyed by handle,
                name or uid; outputs are written in place. ``None`` keys are ignored.
            workspace: a device buffer of at least ``get_workspace_size()`` bytes, or None.
            handle: a handle to run with.
            override_uids: with ``is_override_shape_enabled=True``: the uids whose dims and
                strides this run overrides.
            override_shapes: their dims, in ``override_uids``' order.
            override_strides: their strides, likewise.
            tensor_uids: the frontend's keyword, accepted.
            stream: a torch stream or raw ``cudaStream_t`` int; the current stream by default.

        Raises:
            ShapeMismatchError: a key not of this graph, an output missing from the pack, or a
                tensor of another geometry.

        Example:
            ```python
            import torch

            import cudnn_attn as cudnn

            q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
            g = cudnn.pygraph()
            Q = g.tensor_like(q, "q")
            O, _ = g.sdpa(Q, Q, Q, use_causal_mask=True)
            O.set_output(True).set_name("o")
            g.build()
            o = torch.empty_like(q)
            g.execute({"q": q, "o": o})
            ```
        """
        found = None
        if override_uids is not None or override_shapes is not None or override_strides is not None:
            self.build()
            found = overridden_runner(self, override_uids, override_shapes, override_strides)
        # Tensors are viewed by memory with the geometry this run checks them against: the override's.
        inputs, outputs = self._variant_pack(variant_pack, found[1] if found is not None else {})
        if found is not None:
            runner, stand_in = found
            check_overridden({**inputs, **outputs}, stand_in, self.name)  # type: ignore[attr-defined]
            values, _ = runner.bind(({stand_in[h]: t for h, t in inputs.items()},))
            runner.bind_out(values, {stand_in[h]: t for h, t in outputs.items()})
            runner.run(values, handle, stream, workspace)
            return
        self(inputs, handle=handle, stream=stream, out=outputs, workspace=workspace)  # type: ignore[operator]

    def _variant_pack(
        self, variant_pack: Mapping[Any, Any], stand_in: Mapping[Any, Any]
    ) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """The pack's inputs and outputs by handle, the graph built; unknown keys and missing outputs
        raise. ``stand_in``: handle -> its stand-in under this run's overrides (its geometry)."""
        if not isinstance(variant_pack, Mapping):
            raise ValidationError([f"variant_pack: {type(variant_pack).__name__}; expected a dict of handle -> tensor"])
        self.build()
        recording = self.recording  # type: ignore[attr-defined]
        inputs: dict[Any, Any] = {}
        outputs: dict[Any, Any] = {}
        unknown: list[str] = []
        read = set(recording.inputs)
        for key, value in variant_pack.items():
            handle = resolve(recording, key)
            if handle is None:
                if key is not None:
                    unknown.append(f"{key!r}: not a tensor of this graph (keys: handles, names or uids)")
                continue
            if handle.ragged_offset is None:  # a ragged tensor is bound by its memory as it is
                value = interop.same_memory_view(value, stand_in.get(handle, handle).spec)
            if isinstance(handle, InputHandle):
                if handle in read:  # a tensor of the graph no node reads is not bound, as in the frontend
                    inputs[handle] = value
            else:
                outputs[handle] = value
        if unknown:
            raise ShapeMismatchError(unknown, context="execute")
        missing = [h.name for h in self.outputs if h not in outputs]  # type: ignore[attr-defined]
        if missing:
            raise ShapeMismatchError(
                [f"{name}: missing from the variant pack (outputs are written in place)" for name in missing]
            )
        return inputs, outputs


def _plan_count(node: Node) -> int:
    return node.plan.plan_count() if node.plan is not None else 0


def _single(graph: Any, method: str) -> Node:
    """The graph's one node, built: plan indices address one node's candidates."""
    graph.build()
    if len(graph.nodes) != 1:
        raise UnsupportedError([f"{method}: this graph has {len(graph.nodes)} nodes, each with its own candidate "
                                "plans; plan indices address a one-node graph"], context=graph.name)  # fmt: skip
    return graph.nodes[0]


def _index(graph: Any, index: Any) -> int:
    count = graph.get_execution_plan_count()
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ValidationError([f"index: {index!r}; this graph has {count} candidate plan(s), 0..{count - 1}"],
                              context=graph.name)  # fmt: skip
    return index
