"""``Graph``: the declarative builder, in the cuDNN frontend's vocabulary.

Example::

    with cudnn_attn.Graph() as g:
        o, stats = g.sdpa(q=Q, k=K, v=V, generate_stats=True, use_causal_mask=True)
    O, S = g(Q, K, V)

Inside the block ops only record nodes. Leaving it validates every node (all problems in
one ``ValidationError``) and takes each node's plan from the plan cache, building it on a
miss. Calling the graph checks the run's tensors against the templates and runs the plans.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import interop, lifecycle, validation
from .assembly import assemble_problem
from .cache import PlanCache, default_cache
from .data_type import to_torch_dtype
from .errors import GraphStateError, ShapeMismatchError, UnsupportedError, ValidationError
from .handles import InputHandle, OutputHandle, TensorHandle
from .node import OUTPUT_NAMES, MaskArgs, Node, infer_cache_layout, parse_masks, user_name
from .ops import BACKEND_NAMES, select_backend
from .ops.autotune import enabled_by_default as autotune_default
from .problem import AttentionProblem, Op, TensorSpec
from .runner import Runner

_UNSET: Any = object()


class Graph:
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
        if problems:
            raise ValidationError(problems, context="Graph")
        self.backend = backend
        self.autotune = autotune_default() if autotune is None else bool(autotune)
        self.cache = cache if cache is not None else default_cache()
        self.handle = handle
        self.name = name or "graph"
        self.nodes: list[Node] = []
        self.inputs: list[InputHandle] = []
        self._by_identity: dict[int, InputHandle] = {}
        self._names: set[str] = set()
        self._built = False

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
        self, *, name: str = "", dim: Sequence[int], stride: Sequence[int], data_type: Any, device: str = "cuda:0"
    ) -> InputHandle:
        """An input described without data (the frontend's ``graph.tensor``)."""
        self._check_recording("tensor")
        try:
            dtype = to_torch_dtype(data_type, "data_type")
        except TypeError as error:
            raise ValidationError([str(error)], context="Graph.tensor") from None
        if dtype is None:
            raise ValidationError(["data_type: NOT_SET; give the tensor's data type"], context="Graph.tensor")
        spec = TensorSpec(tuple(int(d) for d in dim), tuple(int(s) for s in stride), dtype, str(torch.device(device)))
        return self._new_input(spec, name or "tensor", None)

    def tensor_like(self, template: Any, name: str = "") -> InputHandle:
        """An input with ``template``'s geometry (the frontend's ``graph.tensor_like``)."""
        self._check_recording("tensor_like")
        tensor = interop.as_torch(template)
        if tensor is None:
            raise ValidationError([f"template: {type(template).__name__}; expected a torch tensor or a DLPack array"])
        handle = self._new_input(TensorSpec.of(tensor), name or "tensor", tensor)
        self._by_identity[id(template)] = handle
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
        if name != handle.name:
            if name in self._names:
                raise ValidationError([f"name: {name!r} is already used in this graph"])
            self._names.discard(handle.name)
            self._names.add(name)
            handle._name = name

    def _bind_input(self, node: Node, role: str, value: Any) -> None:
        """Record ``value`` as ``node``'s input ``role``: a handle, a template tensor or a DLPack array."""
        if value is None:
            return
        if isinstance(value, TensorHandle):
            if value._graph is not self:
                node.errors.append(f"{user_name(role)}: a tensor handle of another graph")
                return
            node.inputs[role] = value  # type: ignore[assignment]
            return
        handle = self._by_identity.get(id(value))
        if handle is None:
            tensor = interop.as_torch(value)
            if tensor is None:
                node.errors.append(
                    f"{user_name(role)}: {type(value).__name__}; expected a tensor (torch, or any DLPack array)"
                )
                return
            handle = self._new_input(TensorSpec.of(tensor), user_name(role), tensor, role)
            self._by_identity[id(value)] = handle
        node.inputs[role] = handle

    # ---- ops -----------------------------------------------------------------------------------

    def sdpa(
        self,
        q: Any,
        k: Any,
        v: Any,
        *,
        attn_scale: Any = None,
        is_inference: bool | None = None,
        generate_stats: bool | None = None,
        use_causal_mask: bool = False,
        use_causal_mask_bottom_right: bool = False,
        sliding_window_length: int | None = None,
        diagonal_alignment: Any = None,
        diagonal_band_left_bound: int | None = None,
        diagonal_band_right_bound: int | None = None,
        attn_bias: Any = None,
        bias: Any = None,
        use_alibi_mask: bool = False,
        use_padding_mask: bool = False,
        seq_len_q: Any = None,
        seq_len_kv: Any = None,
        max_seq_len_q: int | None = None,
        max_seq_len_kv: int | None = None,
        dropout: Any = None,
        dropout_seed: Any = None,
        dropout_offset: Any = None,
        paged_attention_k_table: Any = None,
        paged_attention_v_table: Any = None,
        paged_attention_max_seq_len_kv: int | None = None,
        kv_cache_layout: str | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[OutputHandle, OutputHandle | None]:
        """Scaled dot-product attention forward: ``(O, Stats)``, Stats ``None`` unless generated.

        ``q``/``k``/``v`` are ``[B, H, S, D]`` tensors with any strides (unit last stride),
        or ``[T, H, D]`` packed (THD) tensors with ``seq_len_q``/``seq_len_kv``. With
        ``paged_attention_k_table``, ``k``/``v`` are paged caches (see ``sdpa_with_paged_cache``).
        ``attn_scale`` defaults to ``1/sqrt(d_qk)``. ``generate_stats`` defaults to False.
        """
        node = self._new_node(Op.FORWARD, name)
        for role, value in (("q", q), ("k", k), ("v", v)):
            self._bind_input(node, role, value)
        masks = MaskArgs(
            attn_scale, use_causal_mask, use_causal_mask_bottom_right, sliding_window_length,
            diagonal_alignment, diagonal_band_left_bound, diagonal_band_right_bound, attn_bias, bias,
            use_alibi_mask, use_padding_mask, seq_len_q, seq_len_kv, max_seq_len_q, max_seq_len_kv,
            dropout, dropout_seed, dropout_offset,
        )  # fmt: skip
        parse_masks(self, node, masks, _is_thd(node))
        stats = _resolve_stats(is_inference, generate_stats, node.errors)
        self._check_dtype_arg(compute_data_type, node)
        paged = paged_attention_k_table is not None or paged_attention_v_table is not None
        if paged:
            self._bind_input(node, "page_table_k", paged_attention_k_table)
            self._bind_input(
                node,
                "page_table_v",
                paged_attention_v_table if paged_attention_v_table is not None else paged_attention_k_table,
            )
            node.options["padding"] = True  # paged caches are read through per-sequence lengths
            node.options["max_seq_len_kv"] = paged_attention_max_seq_len_kv or node.options["max_seq_len_kv"]
            k_handle, q_handle = node.inputs.get("k"), node.inputs.get("q")
            if k_handle is not None and q_handle is not None and k_handle.spec and q_handle.spec:
                node.options["kv_cache_layout"] = infer_cache_layout(
                    k_handle.spec, q_handle.spec, kv_cache_layout, node.errors
                )
        elif paged_attention_max_seq_len_kv is not None:
            node.errors.append("paged_attention_max_seq_len_kv: given without paged caches (paged_attention_k_table)")
        o = self._new_output(node, "o")
        s = self._new_output(node, "stats") if stats else None
        self.nodes.append(node)
        return o, s

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
        **mask_keywords: Any,
    ) -> tuple[OutputHandle, None]:
        """Attention over paged K/V caches, for decode (S_q = 1) and chunked prefill.

        ``k``/``v`` are caches ``[num_pages, page_size, H_kv, D]`` (or, with
        ``kv_cache_layout="NHPD"``, ``[num_pages, H_kv, page_size, D]``); ``page_table`` is
        ``[B, pages_per_seq]`` (or ``[B, 1, pages_per_seq, 1]``) int32; ``seq_len_kv`` [B]
        int32 gives each sequence's valid cache length, ``seq_len_q`` defaults to S_q.
        """
        o, _ = self.sdpa(
            q, k, v,
            seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, use_padding_mask=True,
            paged_attention_k_table=page_table,
            paged_attention_v_table=page_table_v if page_table_v is not None else page_table,
            paged_attention_max_seq_len_kv=max_seq_len_kv, kv_cache_layout=kv_cache_layout,
            generate_stats=False, **mask_keywords,
        )  # fmt: skip
        return o, None

    def sdpa_backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        o: Any,
        dO: Any,  # noqa: N803 - the frontend's spelling
        stats: Any,
        *,
        attn_scale: Any = None,
        use_causal_mask: bool = False,
        use_causal_mask_bottom_right: bool = False,
        sliding_window_length: int | None = None,
        diagonal_alignment: Any = None,
        diagonal_band_left_bound: int | None = None,
        diagonal_band_right_bound: int | None = None,
        attn_bias: Any = None,
        bias: Any = None,
        use_alibi_mask: bool = False,
        use_padding_mask: bool = False,
        seq_len_q: Any = None,
        seq_len_kv: Any = None,
        max_seq_len_q: int | None = None,
        max_seq_len_kv: int | None = None,
        dropout: Any = None,
        dropout_seed: Any = None,
        dropout_offset: Any = None,
        use_deterministic_algorithm: bool = False,
        bias_grad: bool = False,
        compute_data_type: Any = None,
        name: str | None = None,
    ) -> tuple[OutputHandle, ...]:
        """Gradients of sdpa: ``(dQ, dK, dV)``, plus ``dBias`` when ``bias_grad=True``.

        Give the same mask, bias, scale and dropout (seed and offset included) as the
        forward whose ``o`` and ``stats`` are passed.
        """
        node = self._new_node(Op.BACKWARD, name)
        for role, value in (("q", q), ("k", k), ("v", v), ("o", o), ("d_o", dO), ("stats", stats)):
            self._bind_input(node, role, value)
        masks = MaskArgs(
            attn_scale, use_causal_mask, use_causal_mask_bottom_right, sliding_window_length,
            diagonal_alignment, diagonal_band_left_bound, diagonal_band_right_bound, attn_bias, bias,
            use_alibi_mask, use_padding_mask, seq_len_q, seq_len_kv, max_seq_len_q, max_seq_len_kv,
            dropout, dropout_seed, dropout_offset,
        )  # fmt: skip
        parse_masks(self, node, masks, _is_thd(node))
        self._check_dtype_arg(compute_data_type, node)
        node.options["deterministic"] = bool(use_deterministic_algorithm)
        outputs = [self._new_output(node, role) for role in ("d_q", "d_k", "d_v")]
        if bias_grad:
            outputs.append(self._new_output(node, "d_bias"))
        self.nodes.append(node)
        return tuple(outputs)

    def _new_node(self, op: Op, name: str | None) -> Node:
        self._check_recording(op.value)
        count = sum(1 for n in self.nodes if n.op is op)
        return Node(op=op, name=name or (op.value if count == 0 else f"{op.value}_{count}"))

    def _new_output(self, node: Node, role: str) -> OutputHandle:
        base = OUTPUT_NAMES[role]
        handle = OutputHandle(
            self, self._unique_name(base if len(self.nodes) == 0 else f"{node.name}::{base}"), node, role
        )
        node.outputs[role] = handle
        return handle

    def _check_dtype_arg(self, value: Any, node: Node) -> None:
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

    # ---- build -----------------------------------------------------------------------------

    def build(self) -> Graph:
        """Validate every node, then get each node's plan from the cache (building on a miss).

        Called on leaving the ``with`` block; calling it again does nothing.
        """
        if self._built:
            return self
        if not self.nodes:
            raise ValidationError(["graph: no ops were recorded; call g.sdpa(...) inside the `with` block"])
        found: list[str] = []
        prefix = len(self.nodes) > 1
        for node in self.nodes:
            lines = list(node.errors)
            problem = self._make_problem(node)
            if problem is None:
                lines = lines or ["inputs: q, k and v must all be given (an input may come from a node that failed)"]
            else:
                # Structural problems are reported alongside argument errors: all problems at once.
                lines += [line for line in validation.problems(problem) if line not in lines]
                if not lines:
                    lines += validation.value_problems(problem, self._templates(node))
                node.problem = problem
                self._fill_output_specs(node, problem)
            found += [f"{node.name}: {line}" if prefix else line for line in lines]
        if found:
            raise ValidationError(found, context=f"{self.name}")
        reasons: list[str] = []
        for node in self.nodes:
            assert node.problem is not None
            try:
                backend = select_backend(self.backend, node.problem)
            except UnsupportedError as error:
                reasons += [f"{node.name}: {r}" if prefix else r for r in error.problems]
                alternatives = error.alternatives
                continue
            tune = self.autotune and backend.name == "cudnn"  # the reference has nothing to tune
            key = (backend.name, backend.plan_key(node.problem), node.problem, tune)
            node.backend = backend.name
            build = functools.partial(backend.build, node.problem, autotune=tune, store=self.cache.store)
            node.plan = self.cache.get_or_build(key, build)
        if reasons:
            raise UnsupportedError(reasons, context=self.name, alternatives=alternatives)
        self._built = True
        self._runner = Runner(self.name, self.inputs, self.nodes, self.handle)
        lifecycle.track_graph(self)
        # Templates only served the build-time checks: holding them would keep the first
        # call's tensors alive for as long as the graph is cached.
        for handle in self.inputs:
            handle.template = None
        self._by_identity.clear()
        return self

    def _templates(self, node: Node) -> dict[str, torch.Tensor]:
        """The data of the node's template inputs, for build-time value checks."""
        return {
            role: h.template for role, h in node.inputs.items() if isinstance(h, InputHandle) and h.template is not None
        }

    def _make_problem(self, node: Node) -> AttentionProblem | None:
        return assemble_problem(node, self._dtypes)

    def _fill_output_specs(self, node: Node, problem: AttentionProblem) -> None:
        for role, handle in node.outputs.items():
            handle._spec = getattr(problem, role)

    # Frontend-compatible build steps: all of them amount to build().
    def validate(self) -> Graph:
        return self.build()

    def build_operation_graph(self) -> Graph:
        return self.build()

    def create_execution_plans(self, *heuristics: Any) -> Graph:
        return self.build()

    def check_support(self, *args: Any) -> Graph:
        return self.build()

    def build_plans(self, *args: Any) -> Graph:
        return self.build()

    def get_workspace_size(self) -> int:
        self.build()
        return max((getattr(node.plan, "workspace_size", 0) for node in self.nodes), default=0)

    @property
    def problems(self) -> list[AttentionProblem]:
        """The built problem of each node (the cache keys), once built."""
        return [node.problem for node in self.nodes if node.problem is not None]

    @property
    def outputs(self) -> list[OutputHandle]:
        return [h for node in self.nodes for h in node.outputs.values() if h.is_output]

    # ---- run -----------------------------------------------------------------------------------

    def __call__(
        self, *args: Any, handle: Any = None, stream: Any = None, out: Any = None, workspace: Any = None
    ) -> Any:
        """Run the graph: ``g(q, k, v, ...)`` positionally or ``g({name: tensor})``.

        Returns the one output, or a tuple of the outputs in node order.
        """
        if not self._built:
            self.build()
        return self._runner(args, handle, stream, out, workspace)

    def execute(
        self, variant_pack: Mapping[Any, Any], workspace: Any = None, handle: Any = None, stream: Any = None
    ) -> None:
        """The frontend's form: ``variant_pack`` maps every handle (inputs and outputs) to a tensor."""
        if not self._built:
            self.build()
        inputs = {h: t for h, t in variant_pack.items() if isinstance(h, InputHandle)}
        outputs = {h: t for h, t in variant_pack.items() if isinstance(h, OutputHandle)}
        missing = [h.name for h in self.outputs if h not in outputs]
        if missing:
            raise ShapeMismatchError(
                [f"{name}: missing from the variant pack (outputs are written in place)" for name in missing]
            )
        self._runner((inputs,), handle, stream, outputs, workspace)

    def _release(self) -> None:
        """Drop this graph's plans (at interpreter exit); calling it afterwards raises."""
        for node in self.nodes:
            node.plan = None
        self._runner = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        state = "built" if self._built else "recording"
        nodes = ", ".join(n.problem.describe() if n.problem else n.name for n in self.nodes)
        return f"<cudnn_attn.Graph {self.name} ({state}): {nodes}>"


def _is_thd(node: Node) -> bool:
    q = node.inputs.get("q")
    return q is not None and q.spec is not None and q.spec.rank == 3


def _resolve_stats(is_inference: bool | None, generate_stats: bool | None, errors: list[str]) -> bool:
    if is_inference is not None and generate_stats is not None and bool(is_inference) == bool(generate_stats):
        errors.append(
            f"generate_stats: {generate_stats} contradicts is_inference={is_inference}; "
            "stats are generated exactly when not in inference (give one of the two)"
        )
    if generate_stats is not None:
        return bool(generate_stats)
    return not is_inference if is_inference is not None else False
