"""``Graph``: the declarative builder, in the cuDNN frontend's vocabulary.

Example::

    with cudnn_attn.Graph() as g:
        o, stats = g.sdpa(q=Q, k=K, v=V, generate_stats=True, use_causal_mask=True)
    O, S = g(Q, K, V)

Inside the block ops only record their calls (``recording/state.py``). Leaving it builds them
(``recording/build.py``): every node validated, all problems in one ``ValidationError``, each
node's plan taken through the runtime's planner (the plan cache, built on a miss). Calling the
graph runs the plans (``runtime/runner.py``). This file holds Graph's public methods only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .cache import PlanCache, default_cache
from .core.dtypes import data_type, to_torch_dtype
from .core.problem import AttentionProblem, Op, TensorSpec, contiguous_strides, device_name
from .core.roles import BACKWARD_INPUTS, PAGED_INPUTS, SDPA_INPUTS
from .errors import GraphStateError, UnsupportedError, ValidationError
from .ops import BACKEND_NAMES
from .ops.cudnn.autotune import enabled_by_default as autotune_default
from .recording import declared, reuse, state
from .recording import frontend_steps as steps
from .recording.build import plan_nodes, positional_inputs, validate_nodes
from .recording.declared import DeclaredIO
from .recording.fp8_ops import Fp8Ops
from .recording.handles import InputHandle, OutputHandle, TensorHandle, handle_spec, ints_or_problem
from .recording.keywords import publishes_mask_keywords, stats_requested
from .runtime import interop, lifecycle
from .runtime.runner import Runner

_DTYPE_ARGUMENTS = ("io_data_type", "intermediate_data_type", "compute_data_type")


class Graph(Fp8Ops, steps.FrontendSteps):
    """A graph of attention nodes, built once and run many times.

    Args:
        io_data_type: dtype of q/k/v/o; ``None`` takes q's. Accepts ``cudnn_attn.data_type``
            members, torch dtypes and the frontend's own enum.
        backend: ``"auto"`` (cuDNN for CUDA tensors, the reference backend for CPU
            tensors), ``"cudnn"`` or ``"reference"``.
        autotune: time every candidate plan and keep the fastest (cuDNN only); ``None`` follows
            ``cudnn_attn.set_autotune`` / ``CUDNN_ATTN_AUTOTUNE=1``.
        cache: the ``PlanCache`` to use; the process-wide ``default_cache()`` by default.

    The frontend's ``pygraph`` parameters are accepted in its positional order (``name``,
    ``io_data_type``, ..., ``cuda_graph_retention``); see ``recording/frontend_steps.py`` for what
    each means here. ``inputs=``/``outputs=`` make it the frontend's pythonic ``cudnn.Graph``: calls
    take the declared inputs in order (or a dict by name) and return the declared outputs
    (``recording/declared.py``); ``heuristics`` and ``workspace_alloc`` are accepted.
    """

    virtual_outputs = False  # every output is produced unless set_output(False); pygraph: the frontend's rule

    def __init__(
        self,
        name: str | None = None,
        io_data_type: Any = None,
        intermediate_data_type: Any = None,
        compute_data_type: Any = None,
        handle: Any = None,
        sm_count: int | None = None,
        sm_version: int | None = None,
        kernel_cache: Any = None,
        device_property: Any = None,
        is_dynamic_shape_enabled: bool = False,
        is_override_shape_enabled: bool = False,
        cuda_graph_retention: Any = None,
        *,
        is_cuda_graph_replay_expected: bool = False,
        inputs: Sequence[Any] | None = None,
        outputs: Sequence[Any] | None = None,
        heuristics: Any = None,
        workspace_alloc: bool = True,
        backend: str = "auto",
        autotune: bool | None = None,
        cache: PlanCache | None = None,
        **kwargs: Any,
    ):
        problems = []
        self._dtypes: dict[str, torch.dtype | None] = dict.fromkeys(_DTYPE_ARGUMENTS)
        if io_data_type is not None or intermediate_data_type is not None or compute_data_type is not None:
            for arg, value in zip(_DTYPE_ARGUMENTS, (io_data_type, intermediate_data_type, compute_data_type)):
                try:
                    self._dtypes[arg] = to_torch_dtype(value, arg)
                except TypeError as error:
                    problems.append(str(error))
        if backend not in BACKEND_NAMES:
            problems.append(f"backend: {backend!r}; allowed {', '.join(map(repr, BACKEND_NAMES))}")
        if cache is not None and not isinstance(cache, PlanCache):
            problems.append(f"cache: {type(cache).__name__}; expected a cudnn_attn.PlanCache")
        frontend = (sm_count, sm_version, kernel_cache, device_property, is_dynamic_shape_enabled,
                    is_override_shape_enabled, cuda_graph_retention, is_cuda_graph_replay_expected)  # fmt: skip
        if kwargs or frontend != steps.FRONTEND_DEFAULTS:  # checked only when given: graphs are made per call
            problems += steps.frontend_options(*frontend, **kwargs)
        if name is not None and not isinstance(name, str):
            problems.append(f"name: {name!r}; expected a string")
        if problems:
            raise ValidationError(problems, context="Graph")
        self.sm_count, self.sm_version = sm_count, sm_version
        self.is_override_shape_enabled = bool(is_override_shape_enabled)  # execute(override_*) allowed
        # The frontend's pythonic Graph: call order declared by name (recording/declared.py).
        self.declared = (list(inputs or ()), list(outputs or ())) if inputs is not None or outputs is not None else None
        self._io: DeclaredIO | None = None
        self.backend = backend
        self.autotune = autotune_default() if autotune is None else bool(autotune)
        self.cache = cache if cache is not None else default_cache()
        self.handle = handle
        self.name = name or "graph"
        declared_key = tuple(map(tuple, self.declared)) if self.declared is not None else None
        self.recording = state.Recording(self.name, (self.backend, self.autotune, *self._dtypes.values(), declared_key))
        if declared_key is not None and not all(isinstance(e, (str, int)) for part in declared_key for e in part):
            self.recording.key.keyed = False  # tensors named by object: built in full every time
        self._runner: Runner | None = None

    # ---- context manager ------------------------------------------------------------------

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.build()

    is_built = property(lambda self: self.recording.built)
    nodes = property(lambda self: self.recording.nodes)

    @property
    def inputs(self) -> list[InputHandle]:
        """The graph's inputs: in creation order while recording, in positional order once built."""
        return self.recording.inputs

    # ---- tensors -----------------------------------------------------------------------------

    def tensor(
        self,
        dim: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        data_type: Any = None,
        is_virtual: bool = False,
        is_pass_by_value: bool = False,
        ragged_offset: Any = None,
        reordering_type: Any = None,
        name: str = "",
        uid: int | None = None,
        ragged_offset_multiplier: int = 1,
        alignment_value: int = 1,
        *,
        device: Any = None,
    ) -> InputHandle:
        """An input described without data (the frontend's ``graph.tensor``, in its positional order).

        ``stride`` defaults to row-major, ``data_type`` to the graph's ``io_data_type``; ``device``
        to the current CUDA device where there is one, else (and for pass-by-value scalars) the CPU. ``alignment_value`` is a
        promise about the values, accepted as given.
        """
        self.recording.check_open("tensor")
        unsupported = steps.frontend_tensor_options(is_virtual, reordering_type, ragged_offset_multiplier)
        if unsupported:
            raise UnsupportedError(unsupported, context="Graph.tensor")
        problems: list[str] = []
        if dim is None:
            problems.append("dim: missing; give the tensor's dims")
        shape = ints_or_problem(dim, "dim", problems) if dim is not None else None
        strides = ints_or_problem(stride, "stride", problems) if stride is not None else None
        if shape is not None and strides is None:
            strides = contiguous_strides(shape)
        if shape is not None and strides is not None and len(shape) != len(strides):
            problems.append(f"stride: {len(strides)} strides for {len(shape)} dims; give one stride per dim")
        try:
            dtype = to_torch_dtype(data_type, "data_type") or self._dtypes["io_data_type"]
            if dtype is None:
                problems.append("data_type: NOT_SET; give the tensor's data type (or the graph's io_data_type)")
        except TypeError as error:
            problems.append(str(error))
        on_host = is_pass_by_value or not torch.cuda.is_available()  # pass-by-value scalars live on the host
        where = device if device is not None else ("cpu" if on_host else "cuda")
        try:
            device_str = device_name(where)
        except (RuntimeError, ValueError, TypeError):
            problems.append(f"device: {device!r} is not a device; give e.g. 'cuda:0' or 'cpu'")
        if not isinstance(name, str):
            problems.append(f"name: {name!r}; expected a string")
        if problems:
            raise ValidationError(problems, context="Graph.tensor")
        assert shape is not None and strides is not None and dtype is not None
        handle = self.recording.made_input(TensorSpec(shape, strides, dtype, device_str), name or "tensor", None)
        handle.is_pass_by_value = bool(is_pass_by_value)
        if uid is not None:
            handle.set_uid(uid)
        if ragged_offset is not None:
            handle.set_ragged_offset(ragged_offset)
        return handle

    def tensor_like(self, template: Any, name: str = "") -> InputHandle:
        """An input with ``template``'s geometry (the frontend's ``graph.tensor_like``): a tensor, a
        DLPack array, or another graph tensor (an input, or an output whose dims are set)."""
        self.recording.check_open("tensor_like")
        if isinstance(template, TensorHandle):
            return self.recording.made_input(handle_spec(template), name or template.name, None)
        tensor = interop.as_torch(template)
        if tensor is None:
            raise ValidationError(
                [f"template: {type(template).__name__}; expected a torch tensor, a DLPack array or a graph tensor"]
            )
        handle = self.recording.made_input(TensorSpec.of(tensor), name or "tensor", tensor)
        self.recording.by_identity[id(template)] = handle
        return handle

    # ---- ops -----------------------------------------------------------------------------------
    # Each op records its call and returns its output handles; the call is interpreted (keywords
    # parsed, tensors bound) when the graph is built, and only where no earlier build of the same
    # recording can be adopted (recording/reuse.py).

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
        rng_dump: Any = None,
        name: str | None = None,
        **mask: Any,
    ) -> tuple[OutputHandle, OutputHandle | None]:
        """Scaled dot-product attention forward: ``(O, Stats)``, Stats ``None`` unless generated.

        ``q``/``k``/``v`` are ``[B, H, S, D]`` tensors with any strides (unit last stride),
        or ``[T, H, D]`` packed (THD) tensors with ``seq_len_q``/``seq_len_kv``. With
        ``paged_attention_k_table``, ``k``/``v`` are paged caches (see ``sdpa_with_paged_cache``).
        ``attn_scale`` defaults to ``1/sqrt(d_qk)``. ``generate_stats`` defaults to False.
        The mask keywords are those of ``cudnn_attn.recording.keywords.MaskKeywords``. ``rng_dump``:
        a float32 ``[B, H_q, S_q, S_kv]`` tensor the caller made (the frontend's debug output) that
        receives the dropout keep-mask (on the reference backend, its own mask: 1 kept, 0 dropped).
        """
        if kv_cache_layout is None and self.virtual_outputs and paged_attention_k_table is not None:
            kv_cache_layout = "NHPD"  # pygraph: caches are [num_pages, H_kv, page_size, D] by dims, as in the frontend
        args = (q, k, v, is_inference, generate_stats, paged_attention_k_table, paged_attention_v_table,
                paged_attention_max_seq_len_kv, kv_cache_layout, compute_data_type, rng_dump)  # fmt: skip
        stats = stats_requested(is_inference, generate_stats, [])  # its errors are reported at build
        outputs = ("o", "stats") if stats else ("o",)
        node = self.recording.record_call(Op.FORWARD, name, SDPA_INPUTS, "sdpa", state.interpret_sdpa, args, mask,
                                          outputs + (("rng_dump",) if rng_dump is not None else ()))  # fmt: skip
        if rng_dump is not None:
            self.recording.caller_output(node, "rng_dump", rng_dump)
        return node.outputs["o"], node.outputs.get("stats")

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
        node = self.recording.record_call(
            Op.FORWARD, name, PAGED_INPUTS, "sdpa_with_paged_cache", state.interpret_paged, args, mask, ("o",)
        )
        return node.outputs["o"], None

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
        dBias: Any = None,  # noqa: N803 - the frontend's spelling
        compute_data_type: Any = None,
        name: str | None = None,
        dSink_token: Any = None,  # noqa: N803 - the frontend's spelling
        **mask: Any,
    ) -> tuple[OutputHandle, ...]:
        """Gradients of sdpa: ``(dQ, dK, dV)``, plus ``dBias`` when ``bias_grad=True``.

        Give the same mask, bias, scale and dropout (seed and offset included) as the
        forward whose ``o`` and ``stats`` are passed. ``dBias``: the frontend's form, a tensor
        the caller made (``g.tensor_like(d_bias)``, any strides) that receives the bias gradient;
        the call then returns ``(dQ, dK, dV)`` and ``execute`` takes that tensor as an output.
        ``dSink_token``: likewise, a ``[1, H_q, 1, 1]`` float32 tensor receiving ``sink_token``'s gradient.
        """
        args = (q, k, v, o, dO, stats, use_deterministic_algorithm, bias_grad, dBias, compute_data_type)
        roles = (
            ("grad_q", "grad_k", "grad_v", "grad_bias")
            if state.flag_true(bias_grad) or dBias is not None
            else ("grad_q", "grad_k", "grad_v")
        )
        node = self.recording.record_call(Op.BACKWARD, name, BACKWARD_INPUTS, "sdpa_backward", state.interpret_backward,
                                          args, mask, roles + (("grad_sink",) if dSink_token is not None else ()))  # fmt: skip
        for role, given in (("grad_bias", dBias), ("grad_sink", dSink_token)):
            if given is not None:
                self.recording.caller_output(node, role, given)
        if dBias is not None or dSink_token is not None:
            return tuple(node.outputs[role] for role in ("grad_q", "grad_k", "grad_v"))
        return tuple(node.outputs.values())

    # ---- build and run -------------------------------------------------------------------------

    def build(self, heuristics: Any = None) -> Graph:
        """Validate every node, then get each node's plan from the cache (building on a miss).

        Called on leaving the ``with`` block; calling it again does nothing. A recording that
        repeats an earlier one (same ops, arguments, geometry, options) adopts that build.
        ``heuristics``: the frontend's ``build([heur_mode.A, ...])`` list, accepted (the plan
        cache asks cuDNN for mode A with FALLBACK behind it).
        """
        recording = self.recording
        if heuristics is not None and (problems := steps.heuristics_problems(heuristics)):
            raise ValidationError(problems, context=self.name)
        if recording.built:
            return self
        if self.declared is not None:  # declared outputs are marked; the others are virtual
            for entry in self.declared[1]:
                handle = declared.resolve(recording, entry)
                if isinstance(handle, OutputHandle):
                    handle.marked = handle.is_output = True
        if self.virtual_outputs or self.declared is not None:
            recording.settle_outputs()
        # A build that failed validation has interpreted its calls already: it is built in full again.
        key = None if recording.interpreted else recording.key.key(recording)
        earlier = self.cache.recorded.get(key) if key is not None else None
        if earlier is not None and self.cache.touch(earlier.cache_keys):
            self._runner = reuse.adopt(recording, earlier, self.handle)
        else:
            recording.interpret()
            dtypes = {**self._dtypes, "io_data_type": None} if self.virtual_outputs else self._dtypes
            validate_nodes(recording.nodes, dtypes, self.name)
            plan_nodes(recording.nodes, self.backend, self.autotune, self.cache, self.name)
            recording.inputs = positional_inputs(recording.nodes)
            self._runner = Runner(self.name, recording.inputs, recording.nodes, self.handle)
            recorded = reuse.recorded(recording, self._runner) if key is not None else None
            if recorded is not None:
                self.cache.recorded.put(key, recorded)
        recording.built = True
        if self.declared is not None:
            self._io = DeclaredIO(recording, *self.declared, context=self.name)
        lifecycle.track_releasable(self)
        recording.forget_tensors()
        return self

    def __call__(
        self, *args: Any, handle: Any = None, stream: Any = None, out: Any = None, workspace: Any = None
    ) -> Any:
        """Run the graph: ``g(q, k, v, ...)`` positionally or ``g({name: tensor})``.

        Returns the one output, or a tuple of the outputs in node order.
        """
        if not self.recording.built:
            self.build()
        runner = self._runner
        if runner is None:
            raise GraphStateError(f"{self.name}: this graph's plans were released (the interpreter is exiting)")
        if self._io is not None:
            return self._io.call(lambda given, given_out: runner((given,), handle, stream, given_out, workspace),
                                 args, out)  # fmt: skip
        return runner(args, handle, stream, out, workspace)

    def run_roles(self, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        """Run a one-node graph on tensors named by role, unchecked (``Runner.run_roles``): the
        library's packed (varlen) path, which checks geometry itself and serves every token
        count of a batch geometry with one graph."""
        if not self.recording.built:
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

    def release(self) -> None:
        """Drop this graph's plans (done at interpreter exit); calling the graph afterwards raises."""
        for node in self.nodes:
            node.plan = None
        self._runner = None

    def __repr__(self) -> str:
        status = "built" if self.recording.built else "recording"
        nodes = ", ".join(n.problem.describe() if n.problem else n.name for n in self.nodes)
        return f"<cudnn_attn.Graph {self.name} ({status}): {nodes}>"


class pygraph(Graph):  # noqa: N801 - the frontend's spelling
    """``Graph`` with the frontend's rules, for code written against ``cudnn.pygraph``: once any
    output is marked with ``set_output(True)``, the outputs never marked are virtual (not
    produced, absent from the variant pack); a graph with no output marked produces them all.
    ``io_data_type`` is the type of tensors made without one, never a constraint on the others."""

    virtual_outputs = True


@contextmanager
def graph(handle: Any, name: str = "cudnn_graph", io_data_type: Any = data_type.HALF,
          intermediate_data_type: Any = data_type.FLOAT, compute_data_type: Any = data_type.FLOAT,
          **graph_kwargs: Any) -> Iterator[tuple[pygraph, list]]:  # fmt: skip
    """The frontend's ``with cudnn.graph(handle) as (g, _):``: a ``pygraph`` (with the frontend's
    io/intermediate/compute defaults) and an empty list; nothing is built on leaving the block
    (``cudnn_attn.jit`` builds, or the caller does)."""
    yield pygraph(name, io_data_type, intermediate_data_type, compute_data_type, handle, **graph_kwargs), []
