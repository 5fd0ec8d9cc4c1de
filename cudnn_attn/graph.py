"""``Graph``: the declarative builder, in the cuDNN frontend's vocabulary.

Example::

    with cudnn_attn.Graph() as g:
        o, stats = g.sdpa(q=Q, k=K, v=V, generate_stats=True, use_causal_mask=True)
    O, S = g(Q, K, V)

Inside the block ops only record nodes (this file). Leaving it builds them (``build.py``):
every node validated, all problems in one ``ValidationError``, each node's plan taken from
the plan cache and built on a miss. Calling the graph runs the plans (``runner.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .cache import PlanCache, default_cache
from .core.dtypes import to_torch_dtype
from .core.problem import AttentionProblem, Op, TensorSpec, contiguous_strides, device_name
from .core.roles import BACKWARD_INPUTS, PAGED_INPUTS, ROLES, SDPA_INPUTS
from .errors import GraphStateError, ValidationError
from .ops import BACKEND_NAMES
from .ops.cudnn.autotune import enabled_by_default as autotune_default
from .recording import reuse as recorded_builds
from .recording.build import plan_nodes, positional_inputs, validate_nodes
from .recording.fp8_ops import Fp8Ops
from .recording.frontend_steps import FrontendSteps
from .recording.handles import InputHandle, OutputHandle, TensorHandle, int_tuple
from .recording.key import RecordingKey
from .recording.keywords import MaskKeywords, collect_keywords, parse_keywords, publishes_mask_keywords, stats_requested
from .recording.node import Node
from .runtime import interop, lifecycle
from .runtime.runner import Runner

# Why a keyword is refused where users might expect it.
_PAGED_HINTS = {
    "generate_stats": "paged attention is forward inference: it returns no stats",
    "is_inference": "paged attention is always inference",
    "paged_attention_k_table": "pass the page table as the 4th argument, page_table",
    "paged_attention_v_table": "use page_table_v",
}


class Graph(Fp8Ops, FrontendSteps):
    """A graph of attention nodes, built once and run many times.

    Args:
        io_data_type: dtype of q/k/v/o; ``None`` takes q's. Accepts ``cudnn_attn.data_type``
            members, torch dtypes and the frontend's own enum.
        backend: ``"auto"`` (cuDNN for CUDA tensors, the reference backend for CPU
            tensors), ``"cudnn"`` or ``"reference"``.
        autotune: time every candidate plan and keep the fastest (cuDNN only); ``None`` follows
            ``cudnn_attn.set_autotune`` / ``CUDNN_ATTN_AUTOTUNE=1``.
        cache: the ``PlanCache`` to use; the process-wide ``default_cache()`` by default.
    """

    def __init__(
        self,
        *,
        io_data_type: Any = None,
        intermediate_data_type: Any = torch.float32,
        compute_data_type: Any = torch.float32,
        handle: Any = None,
        backend: str = "auto",
        autotune: bool | None = None,
        cache: PlanCache | None = None,
        name: str | None = None,
    ):
        problems = []
        self._dtypes: dict[str, torch.dtype | None] = {}
        for arg, value in (
            ("io_data_type", io_data_type),
            ("intermediate_data_type", intermediate_data_type),
            ("compute_data_type", compute_data_type),
        ):
            try:
                self._dtypes[arg] = to_torch_dtype(value, arg)
            except TypeError as error:
                problems.append(str(error))
        if backend not in BACKEND_NAMES:
            problems.append(f"backend: {backend!r}; allowed {', '.join(map(repr, BACKEND_NAMES))}")
        if cache is not None and not isinstance(cache, PlanCache):
            problems.append(f"cache: {type(cache).__name__}; expected a cudnn_attn.PlanCache")
        if problems:
            raise ValidationError(problems, context="Graph")
        self.backend = backend
        self.autotune = autotune_default() if autotune is None else bool(autotune)
        self.cache = cache if cache is not None else default_cache()
        self.handle = handle
        self.name = name or "graph"
        self.nodes: list[Node] = []
        self.inputs: list[InputHandle] = []  # in creation order; positional order once built
        self._by_identity: dict[int, InputHandle] = {}
        self._names: set[str] = set()
        self._built = False
        self._runner: Runner | None = None
        # Ops record their calls; building interprets them (or adopts an earlier identical build).
        self._calls: list[tuple[Any, Node, tuple, dict[str, Any]]] = []
        self._interpreted = False
        self._made: list[InputHandle] = []  # handles made with tensor()/tensor_like(), in order
        self._recording = RecordingKey((self.backend, self.autotune, *self._dtypes.values()))
        self._output_count = 0

    # ---- context manager ------------------------------------------------------------------

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.build()

    @property
    def is_built(self) -> bool:
        return self._built

    # ---- tensors -----------------------------------------------------------------------------

    def tensor(
        self, *, name: str = "", dim: Sequence[int], stride: Sequence[int], data_type: Any, device: Any = None
    ) -> InputHandle:
        """An input described without data (the frontend's ``graph.tensor``).

        ``device`` defaults to the current CUDA device where there is one, else the CPU.
        """
        self._check_recording("tensor")
        problems: list[str] = []
        shape, strides = (_ints_or_problem(value, arg, problems) for value, arg in ((dim, "dim"), (stride, "stride")))
        if shape is not None and strides is not None and len(shape) != len(strides):
            problems.append(f"stride: {len(strides)} strides for {len(shape)} dims; give one stride per dim")
        try:
            dtype = to_torch_dtype(data_type, "data_type")
            if dtype is None:
                problems.append("data_type: NOT_SET; give the tensor's data type")
        except TypeError as error:
            problems.append(str(error))
        where = "cuda" if device is None and torch.cuda.is_available() else ("cpu" if device is None else device)
        try:
            device_str = device_name(where)
        except (RuntimeError, ValueError, TypeError):
            problems.append(f"device: {device!r} is not a device; give e.g. 'cuda:0' or 'cpu'")
        if not isinstance(name, str):
            problems.append(f"name: {name!r}; expected a string")
        if problems:
            raise ValidationError(problems, context="Graph.tensor")
        assert shape is not None and strides is not None and dtype is not None
        return self._made_input(TensorSpec(shape, strides, dtype, device_str), name or "tensor", None)

    def tensor_like(self, template: Any, name: str = "") -> InputHandle:
        """An input with ``template``'s geometry (the frontend's ``graph.tensor_like``): a tensor, a
        DLPack array, or another graph tensor (an input, or an output whose dims are set)."""
        self._check_recording("tensor_like")
        if isinstance(template, TensorHandle):
            return self._made_input(_handle_spec(template), name or template.name, None)
        tensor = interop.as_torch(template)
        if tensor is None:
            raise ValidationError(
                [f"template: {type(template).__name__}; expected a torch tensor, a DLPack array or a graph tensor"]
            )
        handle = self._made_input(TensorSpec.of(tensor), name or "tensor", tensor)
        self._by_identity[id(template)] = handle
        return handle

    def _made_input(self, spec: TensorSpec, name: str, template: torch.Tensor | None) -> InputHandle:
        handle = self._new_input(spec, name, template)
        handle.made_index = len(self._made)
        self._made.append(handle)
        return handle

    def _new_input(self, spec: TensorSpec, name: str, template: torch.Tensor | None, role: str = "") -> InputHandle:
        handle = InputHandle(self, self._unique_name(name), spec, role or name, template)
        self.inputs.append(handle)
        return handle

    def _unique_name(self, name: str) -> str:
        candidate, n = name, 1
        while candidate in self._names:
            candidate = f"{name}_{n}"
            n += 1
        self._names.add(candidate)
        return candidate

    def _rename(self, handle: TensorHandle, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValidationError([f"name: {name!r}; expected a non-empty string"])
        if name != handle.name:
            if name in self._names:
                raise ValidationError([f"name: {name!r} is already used in this graph"])
            self._names.discard(handle.name)
            self._names.add(name)
            handle._name = name

    def _bind(self, node: Node, role: str, value: Any) -> None:
        """Record ``value`` as ``node``'s input ``role``: a handle, a template tensor or a DLPack array."""
        if value is None:
            return
        if isinstance(value, TensorHandle):
            if value._graph is not self:
                node.errors.append(f"{node.argument(role)}: a tensor handle of another graph")
            else:
                node.inputs[role] = value  # type: ignore[assignment]
            return
        handle = self._by_identity.get(id(value))
        if handle is None:
            tensor = interop.as_torch(value)
            if tensor is None:
                node.errors.append(
                    f"{node.argument(role)}: {type(value).__name__}; expected a tensor (torch, or any DLPack array)"
                )
                return
            handle = self._new_input(TensorSpec.of(tensor), node.argument(role), tensor, role)
            self._by_identity[id(value)] = handle
        node.inputs[role] = handle

    # ---- ops -----------------------------------------------------------------------------------
    # Each op records its call and returns its output handles; the call is interpreted (keywords
    # parsed, tensors bound) when the graph is built, and only where no earlier build of the same
    # recording can be adopted (recorded_builds.py).

    @publishes_mask_keywords
    def sdpa(
        self,
        q: Any,
        k: Any,
        v: Any,
        *,
        is_inference: bool | None = None,
        generate_stats: bool | None = None,
        paged_attention_k_table: Any = None,
        paged_attention_v_table: Any = None,
        paged_attention_max_seq_len_kv: int | None = None,
        kv_cache_layout: str | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
        **mask: Any,
    ) -> tuple[OutputHandle, OutputHandle | None]:
        """Scaled dot-product attention forward: ``(O, Stats)``, Stats ``None`` unless generated.

        ``q``/``k``/``v`` are ``[B, H, S, D]`` tensors with any strides (unit last stride),
        or ``[T, H, D]`` packed (THD) tensors with ``seq_len_q``/``seq_len_kv``. With
        ``paged_attention_k_table``, ``k``/``v`` are paged caches (see ``sdpa_with_paged_cache``).
        ``attn_scale`` defaults to ``1/sqrt(d_qk)``. ``generate_stats`` defaults to False.
        The mask keywords are those of ``cudnn_attn.recording.keywords.MaskKeywords``.
        """
        args = (q, k, v, is_inference, generate_stats, paged_attention_k_table, paged_attention_v_table,
                paged_attention_max_seq_len_kv, kv_cache_layout, compute_data_type)  # fmt: skip
        stats = stats_requested(is_inference, generate_stats, [])  # its errors are reported at build
        node = self._record_call(Op.FORWARD, name, SDPA_INPUTS, "sdpa", self._interpret_sdpa, args, mask,
                                 ("o", "stats") if stats else ("o",))  # fmt: skip
        return node.outputs["o"], node.outputs.get("stats")

    def _interpret_sdpa(self, node: Node, mask: dict[str, Any], q: Any, k: Any, v: Any, is_inference: Any,
                        generate_stats: Any, table_k: Any, table_v: Any, max_seq_len_kv: Any, layout: Any,
                        compute_data_type: Any) -> None:  # fmt: skip
        self._bind_call(node, {"q": q, "k": k, "v": v}, mask, "sdpa")
        stats_requested(is_inference, generate_stats, node.errors)
        self._check_compute_dtype(compute_data_type, node)
        if table_k is not None or table_v is not None:
            self._paged(node, table_k, table_v if table_v is not None else table_k, max_seq_len_kv, layout)
        elif max_seq_len_kv is not None:
            node.errors.append("paged_attention_max_seq_len_kv: given without paged caches (paged_attention_k_table)")

    @publishes_mask_keywords
    def sdpa_with_paged_cache(
        self,
        q: Any,
        k: Any,
        v: Any,
        page_table: Any,
        *,
        seq_len_q: Any = None,
        seq_len_kv: Any = None,
        page_table_v: Any = None,
        max_seq_len_kv: int | None = None,
        kv_cache_layout: str | None = None,
        name: str | None = None,
        **mask: Any,
    ) -> tuple[OutputHandle, None]:
        """Attention over paged K/V caches, for decode (S_q = 1) and chunked prefill.

        ``k``/``v`` are caches ``[num_pages, page_size, H_kv, D]`` (or, with
        ``kv_cache_layout="NHPD"``, ``[num_pages, H_kv, page_size, D]``); ``page_table`` is
        ``[B, pages_per_seq]`` (or ``[B, 1, pages_per_seq, 1]``) int32; ``seq_len_kv`` [B]
        int32 gives each sequence's valid cache length, ``seq_len_q`` defaults to S_q.
        Runs as ``g(q, k, v, page_table, seq_len_q, seq_len_kv, page_table_v)`` (those given).
        """
        args = (q, k, v, page_table, seq_len_q, seq_len_kv, page_table_v, max_seq_len_kv, kv_cache_layout)
        node = self._record_call(
            Op.FORWARD, name, PAGED_INPUTS, "sdpa_with_paged_cache", self._interpret_paged, args, mask, ("o",)
        )
        return node.outputs["o"], None

    def _interpret_paged(self, node: Node, mask: dict[str, Any], q: Any, k: Any, v: Any, page_table: Any,
                         seq_len_q: Any, seq_len_kv: Any, page_table_v: Any, max_seq_len_kv: Any,
                         layout: Any) -> None:  # fmt: skip
        mask = dict(mask)
        padding = mask.pop("use_padding_mask", True)
        mask.update(seq_len_q=seq_len_q, seq_len_kv=seq_len_kv)
        self._bind_call(node, {"q": q, "k": k, "v": v}, mask, "sdpa_with_paged_cache", _PAGED_HINTS)
        node.spelling.update(page_table_k="page_table", page_table_v="page_table_v")
        if padding is not True:
            node.errors.append(f"use_padding_mask: {padding!r}; paged caches are always read through seq_len_kv")
        if page_table is None:
            node.errors.append("page_table: missing; give the [B, pages_per_seq] int32 page table of the caches")
        table_v = page_table_v if page_table_v is not None else page_table
        self._paged(node, page_table, table_v, max_seq_len_kv, layout)

    @publishes_mask_keywords
    def sdpa_backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        o: Any,
        dO: Any,  # noqa: N803 - the frontend's spelling
        stats: Any,
        *,
        use_deterministic_algorithm: bool = False,
        bias_grad: bool = False,
        compute_data_type: Any = None,
        name: str | None = None,
        **mask: Any,
    ) -> tuple[OutputHandle, ...]:
        """Gradients of sdpa: ``(dQ, dK, dV)``, plus ``dBias`` when ``bias_grad=True``.

        Give the same mask, bias, scale and dropout (seed and offset included) as the
        forward whose ``o`` and ``stats`` are passed.
        """
        args = (q, k, v, o, dO, stats, use_deterministic_algorithm, bias_grad, compute_data_type)
        roles = ("grad_q", "grad_k", "grad_v", "grad_bias") if _true(bias_grad) else ("grad_q", "grad_k", "grad_v")
        node = self._record_call(
            Op.BACKWARD, name, BACKWARD_INPUTS, "sdpa_backward", self._interpret_backward, args, mask, roles
        )
        return tuple(node.outputs.values())

    def _interpret_backward(self, node: Node, mask: dict[str, Any], q: Any, k: Any, v: Any, o: Any, d_o: Any,
                            stats: Any, deterministic: Any, bias_grad: Any, compute_data_type: Any) -> None:  # fmt: skip
        tensors = {"q": q, "k": k, "v": v, "o": o, "grad_o": d_o, "stats": stats}
        self._bind_call(node, tensors, mask, "sdpa_backward")
        self._check_compute_dtype(compute_data_type, node)
        for flag, value in (("use_deterministic_algorithm", deterministic), ("bias_grad", bias_grad)):
            if not isinstance(value, (bool, int)) or value not in (0, 1):
                node.errors.append(f"{flag}: {value!r}; expected True or False")
        node.deterministic = _true(deterministic)

    def _record_call(
        self,
        op: Op,
        name: str | None,
        positional: tuple[str, ...],
        method: str,
        interpret: Any,
        args: tuple,
        mask: dict[str, Any],
        outputs: tuple[str, ...],
    ) -> Node:
        """A new node with its output handles; its call kept for the build to interpret."""
        self._check_recording(method)
        self._recording.add(self, method, name, args, mask)
        count = sum(1 for n in self.nodes if n.op is op)
        node = Node(op=op, name=op.value if count == 0 else f"{op.value}_{count}", positional=positional)
        if name is not None:
            if isinstance(name, str):
                node.name = name
            else:
                node.errors.append(f"name: {name!r}; expected a string")
        self.nodes.append(node)
        for role in outputs:
            self._new_output(node, role)
        self._calls.append((interpret, node, args, mask))
        return node

    def _bind_call(
        self,
        node: Node,
        tensors: dict[str, Any],
        mask: dict[str, Any],
        method: str,
        hints: dict[str, str] | None = None,
    ) -> None:
        """Parse ``node``'s mask keywords and bind its tensors."""
        keywords = collect_keywords(mask, method, hints)
        errors = keywords if isinstance(keywords, list) else []
        q = interop.as_torch(tensors["q"]) if not isinstance(tensors["q"], TensorHandle) else None
        q_spec = tensors["q"].spec if isinstance(tensors["q"], TensorHandle) else None
        ragged = (q is not None and q.dim() == 3) or (q_spec is not None and q_spec.rank == 3)
        parsed = parse_keywords(keywords if isinstance(keywords, MaskKeywords) else MaskKeywords(), ragged=ragged)
        node.parsed = parsed
        node.errors += errors + parsed.errors
        for role, value in [*tensors.items(), *parsed.tensors.items()]:
            self._bind(node, role, value)

    def _paged(self, node: Node, table_k: Any, table_v: Any, max_seq_len_kv: Any, layout: Any) -> None:
        node.paged = True
        self._bind(node, "page_table_k", table_k)
        self._bind(node, "page_table_v", table_v)
        node.kv_cache_layout = layout
        assert node.parsed is not None, "bound after the keywords are parsed"
        if max_seq_len_kv is not None:
            if isinstance(max_seq_len_kv, bool) or not isinstance(max_seq_len_kv, int) or max_seq_len_kv < 1:
                node.errors.append(f"max_seq_len_kv: {max_seq_len_kv!r}; expected an int >= 1")
            else:
                node.parsed.max_seq_len_kv = max_seq_len_kv

    def _new_output(self, node: Node, role: str) -> OutputHandle:
        base = ROLES[role].output or role
        unique = self._unique_name(base if len(self.nodes) == 1 else f"{node.name}::{base}")
        handle = OutputHandle(self, unique, node, role, self._output_count)
        self._output_count += 1
        node.outputs[role] = handle
        return handle

    def _check_compute_dtype(self, value: Any, node: Node) -> None:
        try:
            dtype = to_torch_dtype(value, "compute_data_type")
        except TypeError as error:
            node.errors.append(str(error))
            return
        if dtype is not None and dtype != torch.float32:
            node.errors.append(f"compute_data_type: {dtype}; attention accumulates in float32 (data_type.FLOAT)")

    def _check_recording(self, what: str) -> None:
        if self._built:
            raise GraphStateError(f"{what}: the graph is already built; record ops inside the `with` block")

    # ---- build and run -------------------------------------------------------------------------

    def build(self) -> Graph:
        """Validate every node, then get each node's plan from the cache (building on a miss).

        Called on leaving the ``with`` block; calling it again does nothing. A recording that
        repeats an earlier one (same ops, arguments, geometry, options) adopts that build.
        """
        if self._built:
            return self
        # A build that failed validation has interpreted its calls already: it is built in full again.
        key = None if self._interpreted else self._recording.key(self)
        earlier = self.cache.recorded.get(key) if key is not None else None
        if earlier is not None and self.cache.touch(earlier.cache_keys):
            recorded_builds.adopt(self, earlier)
        else:
            self._interpret()
            validate_nodes(self.nodes, self._dtypes, self.name)
            plan_nodes(self.nodes, self.backend, self.autotune, self.cache, self.name)
            self.inputs = positional_inputs(self.nodes)
            self._runner = Runner(self.name, self.inputs, self.nodes, self.handle)
            recorded = recorded_builds.recorded(self) if key is not None else None
            if recorded is not None:
                self.cache.recorded.put(key, recorded)
        self._built = True
        lifecycle.track_graph(self)
        # Templates only served the build-time checks: holding them would keep the first
        # call's tensors alive for as long as the graph is cached.
        for handle in [*self.inputs, *self._made]:
            handle.template = None
        self._by_identity.clear()
        self._recording.forget()
        return self

    def _interpret(self) -> None:
        """Parse and bind every recorded call (once: a build that failed validation keeps them)."""
        calls, self._calls, self._interpreted = self._calls, [], True
        for interpret, node, args, mask in calls:
            interpret(node, mask, *args)

    def __call__(
        self, *args: Any, handle: Any = None, stream: Any = None, out: Any = None, workspace: Any = None
    ) -> Any:
        """Run the graph: ``g(q, k, v, ...)`` positionally or ``g({name: tensor})``.

        Returns the one output, or a tuple of the outputs in node order.
        """
        if not self._built:
            self.build()
        if self._runner is None:
            raise GraphStateError(f"{self.name}: this graph's plans were released (the interpreter is exiting)")
        return self._runner(args, handle, stream, out, workspace)

    def run_roles(self, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        """Run a one-node graph on tensors named by role, unchecked (``Runner.run_roles``): the
        library's packed (varlen) path, which checks geometry itself and serves every token
        count of a batch geometry with one graph."""
        if not self._built:
            self.build()
        if self._runner is None:
            raise GraphStateError(f"{self.name}: this graph's plans were released (the interpreter is exiting)")
        self._runner.run_roles(inputs, outputs)

    @property
    def problems(self) -> list[AttentionProblem]:
        """The built problem of each node (the cache keys), once built."""
        return [node.problem for node in self.nodes if node.problem is not None]

    @property
    def outputs(self) -> list[OutputHandle]:
        return [h for node in self.nodes for h in node.outputs.values() if h.is_output]

    def nbytes(self) -> int:
        """Device and host memory this graph's plans hold (workspaces, prepared buffers)."""
        return sum(getattr(node.plan, "nbytes", 0) for node in self.nodes)

    def _release(self) -> None:
        """Drop this graph's plans (at interpreter exit); calling it afterwards raises."""
        for node in self.nodes:
            node.plan = None
        self._runner = None

    def __repr__(self) -> str:
        state = "built" if self._built else "recording"
        nodes = ", ".join(n.problem.describe() if n.problem else n.name for n in self.nodes)
        return f"<cudnn_attn.Graph {self.name} ({state}): {nodes}>"


def _true(flag: Any) -> bool:
    return flag is True or (type(flag) is int and flag == 1)


def _ints_or_problem(values: Any, argument: str, problems: list[str]) -> tuple[int, ...] | None:
    try:
        return int_tuple(values, argument)
    except ValidationError as error:
        problems += error.problems
        return None


def _handle_spec(template: TensorHandle) -> TensorSpec:
    """A graph tensor's geometry, for ``tensor_like``: an input's, or an output's as set so far."""
    spec = template.spec
    if spec is not None:
        return spec
    dim, stride, dtype = (getattr(template, attr, None) for attr in ("dim", "stride", "dtype"))
    if dim is None or dtype is None:
        raise ValidationError(
            [
                f"template: graph tensor {template.name!r} has no geometry yet (dims and data type are known once the "
                "graph is built); set_dim() and set_data_type() on it first, or pass a tensor"
            ],
            context="Graph.tensor_like",
        )
    problem = getattr(getattr(template, "node", None), "problem", None)
    node_q = problem.q if problem is not None else None
    device = node_q.device if node_q is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    strides = stride if stride is not None else contiguous_strides(dim)
    return TensorSpec(tuple(dim), tuple(strides), dtype, device_name(device))
