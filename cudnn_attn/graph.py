"""``Graph``: the declarative builder, in the cuDNN frontend's vocabulary.

Example::

    with cudnn_attn.Graph() as g:
        o, stats = g.sdpa(q=Q, k=K, v=V, generate_stats=True, use_causal_mask=True)
    O, S = g(Q, K, V)

Inside the block ops only record their calls (``recording/state.py``). Leaving it builds them
(``recording/build.py``): every node validated, all problems in one ``ValidationError``, each
node's plan taken through the runtime's planner (the plan cache, built on a miss). Calling the
graph runs the plans (``runtime/runner.py``). This file holds Graph's public methods only, with
no base class: what only frontend code uses (``tensor``, the build steps, plan helpers,
``execute``, ``serialize``) delegates to the frontend's dialect, ``frontend/``, which never
imports this file.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .cache import PlanCache, default_cache
from .core.dtypes import data_type
from .core.problem import AttentionProblem
from .errors import GraphStateError, ValidationError
from .frontend import options, plans, serialized, tensors
from .frontend.declared import DeclaredIO, mark_outputs
from .frontend.execute import execute_at_index, execute_pack, ordered_pack
from .ops.cudnn.autotune import enabled_by_default as autotune_default
from .recording import ops_table, state
from .recording.build import runner_for
from .recording.handles import InputHandle, OutputHandle
from .recording.keywords import publishes_mask_keywords
from .runtime import lifecycle
from .runtime.runner import Runner


class Graph:
    """A graph of attention nodes: recorded once, built once, run many times.

    Inside ``with Graph() as g:`` the ops (``sdpa``, ``sdpa_backward``, ``sdpa_with_paged_cache``,
    ``sdpa_fp8``, ``sdpa_fp8_backward``) record nodes; the tensors they are given are templates
    whose shape, strides, dtype and device define the graph, and nothing runs. Leaving the block
    builds: every node is validated (all problems in one ``ValidationError``) and each node's
    plan is taken from the plan cache, built on a miss; a recording identical to an earlier one
    adopts that build. Calling the graph runs the plans on tensors of the same geometry.

    The frontend's ``pygraph`` parameters are accepted in its positional order (``name``,
    ``io_data_type``, ..., ``cuda_graph_retention``). ``inputs=``/``outputs=`` make it the
    frontend's pythonic ``cudnn.Graph``: calls take the declared inputs in order (or a dict by
    name) and return the declared outputs.

    Args:
        name: the graph's name, used in errors and logs (default ``"graph"``).
        io_data_type: dtype of q/k/v/o; None takes q's. Data types accept ``cudnn_attn.data_type``
            members (``HALF``, ``BFLOAT16``, ``FLOAT``, ``FP8_E4M3``, ...), torch dtypes, the
            frontend's enum and their names.
        intermediate_data_type: dtype of the scores and softmax; float32 (the default) only.
        compute_data_type: dtype of the arithmetic; float32 (the default) only.
        handle: a handle from ``create_handle`` (ours or the frontend's), optional: one per
            device and thread is made when none is given.
        sm_count: the frontend's SM count hint; recorded, plans use the whole GPU.
        sm_version: the frontend's target architecture hint; recorded, plans are built for the
            GPU that runs them.
        kernel_cache: the frontend's kernel cache; accepted (the plan cache keeps built plans).
        device_property: the frontend's deviceless compilation; refused (``UnsupportedError``).
        is_dynamic_shape_enabled: accepted; a packed (THD) plan serves every token count anyway.
        is_override_shape_enabled: allow ``execute(override_uids=, override_shapes=,
            override_strides=)``: a run's own dims and strides for some tensors.
        cuda_graph_retention: the frontend's CUDA-graph hint (None, ``PER_GRAPH`` or ``NONE``).
        is_cuda_graph_replay_expected: the frontend's CUDA-graph hint; accepted.
        inputs: declared inputs (handles or names), the pythonic graph's call order.
        outputs: declared outputs (handles or names): calls return these; others are virtual.
        heuristics: the pythonic graph's heuristic modes; accepted (cuDNN mode A, FALLBACK behind).
        workspace_alloc: the pythonic graph's flag; accepted (workspaces are allocated here).
        backend: ``"auto"`` (cuDNN for CUDA tensors, the reference backend for CPU tensors),
            ``"cudnn"``, ``"reference"`` (the pure-PyTorch backend, on any device) or
            ``"torch"`` (torch's SDPA kernel, for the problems it takes; the others are refused
            naming what it lacks).
        autotune: time every candidate cuDNN plan at build and keep the fastest; None follows
            ``cudnn_attn.set_autotune`` and ``CUDNN_ATTN_AUTOTUNE=1``.
        cache: the ``PlanCache`` to take plans from; ``default_cache()`` by default.
        **kwargs: anything else is refused, naming it.

    Raises:
        ValidationError: a bad data type, backend, cache, name or frontend option (every
            problem listed); at build, everything wrong with the recorded ops.
        UnsupportedError: at build, a node this GPU, cuDNN version or backend cannot run.

    Example:
        ```python
        import torch

        import cudnn_attn

        q, k, v = (torch.randn(2, 4, 64, 32, dtype=torch.bfloat16) for _ in range(3))
        with cudnn_attn.Graph() as g:  # ops record; leaving the block builds
            o, stats = g.sdpa(q, k, v, use_causal_mask=True, generate_stats=True)
        O, S = g(q, k, v)  # any tensors of this geometry: [B, H, S, D] bf16 on the CPU here
        assert O.shape == (2, 4, 64, 32) and S.shape == (2, 4, 64, 1)  # Stats: float32 log-sum-exp
        ```
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
        frontend: tuple = (sm_count, sm_version, kernel_cache, device_property, is_dynamic_shape_enabled)
        frontend += (is_override_shape_enabled, cuda_graph_retention, is_cuda_graph_replay_expected)
        dtypes = (io_data_type, intermediate_data_type, compute_data_type)
        self._dtypes = options.graph_arguments(name, dtypes, backend, cache, frontend, kwargs)
        self.sm_count, self.sm_version = sm_count, sm_version
        self.is_override_shape_enabled = bool(is_override_shape_enabled)  # execute(override_*) allowed
        # The frontend's pythonic Graph: call order declared by name (frontend/declared.py).
        self.declared = (list(inputs or ()), list(outputs or ())) if inputs is not None or outputs is not None else None
        self._io: DeclaredIO | None = None
        self.backend = backend
        if autotune is not None and not isinstance(autotune, bool):  # bool("false") is True
            raise ValidationError([f"autotune: {autotune!r}; expected True, False or None"], context="Graph")
        self.autotune = autotune_default() if autotune is None else autotune
        self.cache = cache if cache is not None else default_cache()
        self.handle = handle
        self.name = name or "graph"
        declared_key = tuple(map(tuple, self.declared)) if self.declared is not None else None
        # The frontend's graphs follow its rules: outputs packed and virtual until marked, no
        # scaling where attn_scale is omitted.
        frontend_rules = self.virtual_outputs or declared_key is not None
        self.recording = state.Recording(
            self.name,
            (self.backend, self.autotune, *self._dtypes.values(), declared_key, frontend_rules),
            frontend_rules=frontend_rules,
        )
        if declared_key is not None and not all(isinstance(e, (str, int)) for part in declared_key for e in part):
            self.recording.key.keyed = False  # tensors named by object: built in full every time
        self._runner: Runner | None = None

    # ---- context manager ------------------------------------------------------------------

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.build()

    is_built = property(lambda self: self.recording.built, doc="Whether the graph has been built.")
    nodes = property(lambda self: self.recording.nodes, doc="The recorded nodes, one per op call.")

    @property
    def inputs(self) -> list[InputHandle]:
        """The graph's input handles: in creation order while recording, in positional order once built."""
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

        For frontend code that builds a graph from descriptors and runs it with ``execute``.

        Args:
            dim: the tensor's dims (required).
            stride: its strides; row-major by default.
            data_type: its dtype (``data_type`` member or torch dtype); the graph's
                ``io_data_type`` by default.
            is_virtual: virtual tensors link the frontend's other ops; refused.
            is_pass_by_value: a host scalar (e.g. ``attn_scale``), read at each run.
            ragged_offset: a graph tensor of ``B + 1`` element offsets: this tensor is THD.
            reordering_type: block-scaled layouts; only None or ``NONE`` is taken.
            name: the tensor's name, a key of ``execute``'s variant pack.
            uid: the frontend's uid, another key of the variant pack.
            ragged_offset_multiplier: only 1 (offsets are in elements).
            alignment_value: a promise about the values; accepted as given.
            device: its device; the current CUDA device where there is one, else (and for
                pass-by-value scalars) the CPU.

        Returns:
            The input's handle.

        Raises:
            ValidationError: a missing or malformed dim, stride, data type, device or name.
            UnsupportedError: ``is_virtual``, a reordering or a multiplier other than 1.
            GraphStateError: the graph is already built.
        """
        self.recording.check_open("tensor")
        tensors.refuse_unsupported(is_virtual, reordering_type, ragged_offset_multiplier)
        io_dtype = self._dtypes["io_data_type"]  # a tensor's type when it is given none
        spec = tensors.described_spec(dim, stride, data_type, io_dtype, is_pass_by_value, name, device)
        handle = tensors.described(self.recording, spec, name, is_pass_by_value, uid, ragged_offset)
        handle.strides_given = stride is not None
        return handle

    def tensor_like(self, template: Any, name: str = "", is_virtual: bool = False) -> InputHandle:
        """An input with ``template``'s geometry (the frontend's ``graph.tensor_like``).

        Args:
            template: a torch tensor, a DLPack array, or a graph tensor (an input, or an output
                whose dims and data type are set); a pass-by-value graph tensor's copy is one too.
            name: the input's name; the template's (or ``"tensor"``) by default.
            is_virtual: virtual tensors link the frontend's other ops; refused.

        Returns:
            The input's handle.

        Raises:
            ValidationError: ``template`` is none of those.
            UnsupportedError: ``is_virtual``.
            GraphStateError: the graph is already built.
        """
        tensors.refuse_unsupported(is_virtual, None, 1, context="Graph.tensor_like")
        return tensors.like(self.recording, template, name)

    # ---- ops -----------------------------------------------------------------------------------
    # Each op records its call and returns its output handles; the call is interpreted (keywords
    # parsed, tensors bound) when the graph is built, and only where no earlier build of the same
    # recording can be adopted (recording/reuse.py). Each passes its parameters by name, as
    # locals() (nothing else is bound before): recording/ops_table.py declares which it reads.

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
        """Scaled dot-product attention forward: records a node, returns ``(O, Stats)``.

        ``O = softmax(q @ k^T * attn_scale + masks and bias) @ v``, dropout applied to the
        softmax; ``Stats`` is the log-sum-exp of each row's scaled, masked scores (natural log,
        float32 ``[B, H_q, S_q, 1]``), which ``sdpa_backward`` reads. Tensors: ``[B, H, S, D]``
        with any strides and a unit last stride (BHSD, BSHD and SBHD views, packed QKV), or THD
        ``[T, H, D]`` (sequences back to back) with ``seq_len_q``/``seq_len_kv``; q, k, v share
        one dtype (float16, bfloat16 or float32); head dims are multiples of 8; K/V heads divide
        Q heads (GQA/MQA). The run's positional inputs, in this order, are those given of
        q, k, v, attn_bias, seq_len_q, seq_len_kv, dropout_seed, dropout_offset, the page tables.

        Args:
            q: queries, ``[B, H_q, S_q, D_qk]`` (or THD ``[T_q, H_q, D_qk]``).
            k: keys, ``[B, H_kv, S_kv, D_qk]``; with ``paged_attention_k_table``, a paged cache.
            v: values, ``[B, H_kv, S_kv, D_v]``; with ``paged_attention_v_table``, a paged cache.
            is_inference: the frontend's flag: False generates Stats (for training).
            generate_stats: whether Stats is produced; default False. Given with
                ``is_inference``, the two must agree.
            paged_attention_k_table: page table ``[B, 1, pages_per_seq, 1]`` int32 (K/V are
                then caches ``[num_pages, H_kv, page_size, D]``; cuDNN >= 9.5).
            paged_attention_v_table: V's page table, same form.
            paged_attention_max_seq_len_kv: the longest cache length (default: pages x page size).
            kv_cache_layout: ``"NHPD"`` (``[num_pages, H_kv, page_size, D]``) or ``"NPHD"``.
            compute_data_type: float32 only, as the graph's.
            rng_dump: a float32 ``[B, H_q, S_q, S_kv]`` tensor the caller made that receives the
                dropout keep-mask (1 kept, 0 dropped; the frontend's debug output).
            name: the node's name, prefixing its outputs' names.
            **mask: the mask, scale, length and dropout keywords below (``help(g.sdpa)`` and
                editors list them all).

        Other Parameters:
            attn_scale (float | tensor): factor on ``q @ k^T``; default ``1 / sqrt(D_qk)``. A
                pass-by-value graph tensor is read at each run.
            use_causal_mask (bool): top-left causal: query ``i`` sees keys ``j <= i``.
            use_causal_mask_bottom_right (bool): causal aligned to the last key: query ``i``
                sees keys ``j <= i + S_kv - S_q`` (decode, chunked prefill; cuDNN >= 9.3).
            sliding_window_length (int): a window of W keys, the query's own included, left of
                the diagonal (cuDNN >= 9.2). Alias ``diagonal_band_left_bound``.
            diagonal_band_right_bound (int): keys up to R past the diagonal (0 is causal).
            diagonal_alignment (diagonal_alignment): where the band's diagonal starts,
                ``TOP_LEFT`` or ``BOTTOM_RIGHT``.
            attn_bias (tensor): additive bias broadcastable to ``[B, H_q, S_q, S_kv]`` (alias
                ``bias``); q's dtype.
            use_alibi_mask (bool): ALiBi slopes; with top-left causal only.
            use_padding_mask (bool): mask past each sequence's length (``seq_len_q``/``_kv``).
            seq_len_q (tensor): int32 ``[B, 1, 1, 1]`` (or ``[B]``) valid query lengths.
            seq_len_kv (tensor): int32 ``[B, 1, 1, 1]`` (or ``[B]``) valid key lengths.
            max_seq_len_q (int): THD: the longest query sequence the plan serves.
            max_seq_len_kv (int): THD and paged: the longest key sequence.
            dropout (float | tuple): a probability ``0 <= p < 1``, or the frontend's
                ``(p, seed_tensor, offset_tensor)``.
            dropout_seed (int | tensor): the dropout RNG's seed (int64).
            dropout_offset (int | tensor): the dropout RNG's offset (int64).
            sink_token (tensor): attention sinks, float32 ``[1, H_q, 1, 1]`` (float64 beside float64 queries), one logit per head
                in every softmax denominator (cuDNN >= 9.13).
            score_mod (callable): ``(graph, scores) -> scores``, a pointwise modifier traced at
                build (cuDNN >= 9.6); ``score_mod_bprop`` is its gradient's, backward.

        Returns:
            ``(O, Stats)``: output handles; ``O`` is ``[B, H_q, S_q, D_v]`` in q's layout and
            dtype, ``Stats`` is None unless generated.

        Raises:
            GraphStateError: the graph is already built.

        Problems with the arguments are reported when the graph is built, all together, as a
        ``ValidationError`` (malformed) or an ``UnsupportedError`` (this GPU, cuDNN version or
        backend cannot run it).

        Example:
            ```python
            import torch

            import cudnn_attn

            q = torch.randn(1, 8, 100, 64, dtype=torch.float16)
            k, v = (torch.randn(1, 2, 300, 64, dtype=torch.float16) for _ in range(2))
            with cudnn_attn.Graph() as g:
                o, _ = g.sdpa(q, k, v, use_causal_mask_bottom_right=True, sliding_window_length=128)
            out = g(q, k, v)  # [1, 8, 100, 64]: the last 100 queries of 300 keys, each sees 128
            ```
        """
        if kv_cache_layout is None and self.virtual_outputs and paged_attention_k_table is not None:
            kv_cache_layout = "NHPD"  # pygraph: caches are [num_pages, H_kv, page_size, D] by dims, as in the frontend
        node = self.recording.record_call(ops_table.SDPA, locals())
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

        K and V live in pages of a shared cache; ``page_table`` lists each sequence's pages in
        order, and ``seq_len_kv`` its valid length. Runs as ``g(q, k, v, page_table, seq_len_q,
        seq_len_kv, page_table_v)`` (those given). Needs cuDNN >= 9.5 on a GPU; page sizes are
        powers of two. ``cudnn_attn.PagedAttention`` wraps this for a serving loop.

        Args:
            q: queries ``[B, H_q, S_q, D]``.
            k: K cache ``[num_pages, page_size, H_kv, D]`` (``"NPHD"``, the default), or
                ``[num_pages, H_kv, page_size, D]`` with ``kv_cache_layout="NHPD"``.
            v: V cache, same layout.
            page_table: ``[B, pages_per_seq]`` (or ``[B, 1, pages_per_seq, 1]``) int32 page indices.
            seq_len_q: int32 ``[B]`` valid query lengths; default ``S_q`` for every sequence.
            seq_len_kv: int32 ``[B]`` valid cache lengths.
            page_table_v: V's page table where it differs from K's.
            max_seq_len_kv: the longest cache length (default: pages x page size).
            kv_cache_layout: ``"NPHD"`` or ``"NHPD"``.
            name: the node's name.
            **mask: the mask, scale and dropout keywords of ``sdpa``.

        Returns:
            ``(O, None)``: O's handle, ``[B, H_q, S_q, D]``.

        Raises:
            GraphStateError: the graph is already built.

        Example:
            ```python
            import torch

            import cudnn_attn

            B, H, D, page, pages = 2, 4, 64, 16, 8
            q = torch.randn(B, H, 1, D, dtype=torch.bfloat16)
            k_cache, v_cache = (torch.randn(pages, page, H, D, dtype=torch.bfloat16) for _ in range(2))
            table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
            lengths = torch.tensor([40, 64], dtype=torch.int32)
            with cudnn_attn.Graph() as g:
                o, _ = g.sdpa_with_paged_cache(q, k_cache, v_cache, table, seq_len_kv=lengths)
            out = g(q, k_cache, v_cache, table, lengths)  # [2, 4, 1, 64]
            ```
        """
        node = self.recording.record_call(ops_table.PAGED, locals())
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
        """Gradients of ``sdpa``: records a node, returns ``(dQ, dK, dV)``.

        Give the same mask, bias, scale and dropout (seed and offset included) as the forward
        whose ``o`` and ``stats`` are passed. The run's positional inputs are q, k, v, o, dO,
        stats, then as ``sdpa``'s. Head dims above 128 need Hopper or newer; S_q = S_kv = 1 is
        refused (cuDNN has no such backward).

        Args:
            q: the forward's queries.
            k: the forward's keys.
            v: the forward's values.
            o: the forward's output.
            dO: the gradient of the loss with respect to ``o``, o's shape and dtype.
            stats: the forward's Stats (``generate_stats=True``), float32 ``[B, H_q, S_q, 1]``.
            use_deterministic_algorithm: ask cuDNN for a deterministic dQ (no atomics).
            bias_grad: also return ``dBias``, the gradient of ``attn_bias``.
            dBias: the frontend's form: a tensor the caller made (``g.tensor_like(d_bias)``, any
                strides) that receives the bias gradient; ``execute`` takes it as an output.
            compute_data_type: float32 only.
            name: the node's name.
            dSink_token: a float32 ``[1, H_q, 1, 1]`` tensor the caller made that receives
                ``sink_token``'s gradient.
            **mask: the mask, scale, length and dropout keywords of ``sdpa``.

        Returns:
            ``(dQ, dK, dV)``: output handles with q's, k's and v's shapes, plus ``dBias`` when
            ``bias_grad=True`` (and no ``dBias`` tensor is given).

        Raises:
            GraphStateError: the graph is already built.

        Example:
            ```python
            import torch

            import cudnn_attn

            q, k, v = (torch.randn(2, 4, 64, 32, dtype=torch.bfloat16) for _ in range(3))
            with cudnn_attn.Graph() as fwd:
                fwd.sdpa(q, k, v, use_causal_mask=True, generate_stats=True)
            o, stats = fwd(q, k, v)
            d_o = torch.randn_like(o)
            with cudnn_attn.Graph() as bwd:
                bwd.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)
            dq, dk, dv = bwd(q, k, v, o, d_o, stats)
            ```
        """
        node = self.recording.record_call(ops_table.BACKWARD, locals())
        if dBias is not None or dSink_token is not None:  # the caller's tensors receive them: not returned
            return tuple(node.outputs[role] for role in ("grad_q", "grad_k", "grad_v"))
        return tuple(node.outputs.values())

    @publishes_mask_keywords
    def sdpa_fp8(
        self,
        q: Any,
        k: Any,
        v: Any,
        descale_q: Any,
        descale_k: Any,
        descale_v: Any,
        descale_s: Any,
        scale_s: Any,
        scale_o: Any,
        *,
        is_inference: bool | None = None,
        generate_stats: bool | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
        fn: Any = None,
        **mask: Any,
    ) -> tuple[OutputHandle, OutputHandle | None, OutputHandle, OutputHandle]:
        """FP8 attention forward (the frontend's ``sdpa_fp8``): ``(O, Stats or None, Amax_S, Amax_O)``.

        S = q k^T * attn_scale * descale_q * descale_k; P = softmax(S) (Amax_S = max|P|) is
        quantised with ``scale_s``; O = (P v) * descale_s * descale_v (Amax_O = max|O|) is
        written as ``O * scale_o`` in O's dtype (q's by default). On a GPU this needs Hopper or
        newer and cuDNN >= 9.7 (not 9.10.0), head dims up to 128 (d_qk up to 192); the reference
        backend emulates it exactly on the CPU. ``cudnn_attn.sdpa_fp8`` does the scaling for
        16-bit callers.

        Args:
            q: ``[B, H_q, S_q, D]`` ``torch.float8_e4m3fn`` (or ``float8_e5m2``).
            k: ``[B, H_kv, S_kv, D]``, q's dtype.
            v: ``[B, H_kv, S_kv, D_v]``, q's dtype.
            descale_q: float32 ``[1, 1, 1, 1]``, the inverse of q's quantisation scale.
            descale_k: as ``descale_q``, for k.
            descale_v: as ``descale_q``, for v.
            descale_s: float32 ``[1, 1, 1, 1]``, the inverse of ``scale_s``.
            scale_s: float32 ``[1, 1, 1, 1]``, P's quantisation scale.
            scale_o: float32 ``[1, 1, 1, 1]``, O's quantisation scale.
            is_inference: the frontend's flag: False generates Stats.
            generate_stats: whether Stats is produced; default False.
            compute_data_type: float32 only.
            name: the node's name.
            fn: the frontend's name here for ``score_mod``: ``(graph, S) -> S'`` on the descaled
                scores before the masks (inference only).
            **mask: the mask and scale keywords of ``sdpa`` (``sink_token`` included).

        Returns:
            ``(O, Stats, Amax_S, Amax_O)`` handles; Stats is None unless generated, the amaxes
            are float32 ``[1, 1, 1, 1]``.

        Example:
            ```python
            import torch

            import cudnn_attn

            q, k, v = (torch.randn(1, 2, 64, 64).to(torch.float8_e4m3fn) for _ in range(3))
            def scale(x):  # every scale and descale: a float32 [1, 1, 1, 1] tensor
                return torch.full((1, 1, 1, 1), x)

            # descale_q, descale_k, descale_v (unit: values as stored), descale_s, scale_s, scale_o
            scales = [scale(1.0), scale(1.0), scale(1.0), scale(1 / 448), scale(448.0), scale(1.0)]
            with cudnn_attn.Graph() as g:
                o, _, amax_s, amax_o = g.sdpa_fp8(q, k, v, *scales, use_causal_mask=True)
            out, amax_s, amax_o = g(q, k, v, *scales)  # O in float8_e4m3fn
            ```
        """
        node = self.recording.record_call(ops_table.FP8, locals())
        return node.outputs["o"], node.outputs.get("stats"), node.outputs["amax_s"], node.outputs["amax_o"]

    @publishes_mask_keywords
    def sdpa_fp8_backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        o: Any,
        dO: Any,  # noqa: N803 - the frontend's spelling
        stats: Any,
        descale_q: Any,
        descale_k: Any,
        descale_v: Any,
        descale_o: Any,
        descale_dO: Any,  # noqa: N803
        descale_s: Any,
        descale_dP: Any,  # noqa: N803
        scale_s: Any,
        scale_dQ: Any,  # noqa: N803
        scale_dK: Any,  # noqa: N803
        scale_dV: Any,  # noqa: N803
        scale_dP: Any,  # noqa: N803
        *,
        use_deterministic_algorithm: bool = False,
        compute_data_type: Any = None,
        name: str | None = None,
        dSink_token: Any = None,  # noqa: N803 - the frontend's spelling
        **mask: Any,
    ) -> tuple[OutputHandle, ...]:
        """Gradients of ``sdpa_fp8``: ``(dQ, dK, dV, Amax_dQ, Amax_dK, Amax_dV, Amax_dP)``.

        Give the same mask, scale and ``sink_token`` as the forward whose ``o`` and ``stats``
        are passed. Every scale and descale is a float32 ``[1, 1, 1, 1]`` tensor; the gradients
        are written scaled by ``scale_dQ``/``scale_dK``/``scale_dV`` in q's dtype. Same GPU and
        cuDNN needs as ``sdpa_fp8``, head dims up to 128.

        Args:
            q: the forward's FP8 queries.
            k: the forward's FP8 keys.
            v: the forward's FP8 values.
            o: the forward's FP8 output.
            dO: the output's gradient, FP8.
            stats: the forward's Stats, float32 ``[B, H_q, S_q, 1]``.
            descale_q: q's descale.
            descale_k: k's descale.
            descale_v: v's descale.
            descale_o: o's descale.
            descale_dO: dO's descale.
            descale_s: P's descale.
            descale_dP: dP's descale.
            scale_s: P's scale.
            scale_dQ: dQ's scale.
            scale_dK: dK's scale.
            scale_dV: dV's scale.
            scale_dP: dP's scale.
            use_deterministic_algorithm: ask cuDNN for a deterministic dQ.
            compute_data_type: float32 only.
            name: the node's name.
            dSink_token: a ``[1, H_q, 1, 1]`` float32 tensor the caller made that receives the
                sink's gradient.
            **mask: the mask and scale keywords of ``sdpa``.

        Returns:
            ``(dQ, dK, dV, Amax_dQ, Amax_dK, Amax_dV, Amax_dP)`` handles.
        """
        node = self.recording.record_call(ops_table.FP8_BACKWARD, locals())
        return tuple(handle for role, handle in node.outputs.items() if role != "grad_sink")

    # ---- build and run -------------------------------------------------------------------------

    def build(self, heuristics: Any = None) -> Graph:
        """Validate every node, then take each node's plan from the cache (building on a miss).

        Called on leaving the ``with`` block (and by the first call otherwise); calling it
        again does nothing. A recording that repeats an earlier one (same ops, arguments,
        geometry, options) adopts that build.

        Args:
            heuristics: the frontend's ``build([heur_mode.A, ...])`` list, accepted (the plan
                cache asks cuDNN for mode A with FALLBACK behind it).

        Returns:
            The graph itself.

        Raises:
            ValidationError: every problem with every node, one per line.
            UnsupportedError: a node this GPU, cuDNN version or backend cannot run, with the
                reasons and what would work.
        """
        recording = self.recording
        if heuristics is not None:
            options.check_heuristics([heuristics], self.name)
        if recording.built:
            return self
        if self.declared is not None:
            mark_outputs(recording, self.declared[1])
        if self.virtual_outputs or self.declared is not None:
            recording.settle_outputs()
        dtypes = {**self._dtypes, "io_data_type": None} if self.virtual_outputs else self._dtypes
        self._runner = runner_for(recording, dtypes, self.backend, self.autotune, self.cache, self.handle)
        recording.built = True
        if self.declared is not None:
            self._io = DeclaredIO(recording, *self.declared, context=self.name)
        lifecycle.track_releasable(self)
        recording.forget_tensors()
        return self

    def __call__(
        self,
        *args: Any,
        handle: Any = None,
        stream: Any = None,
        out: Any = None,
        workspace: Any = None,
        **unknown: Any,
    ) -> Any:
        """Run the graph: ``g(q, k, v, ...)`` positionally, or ``g({name: tensor})``.

        Positional inputs are the graph's distinct input tensors, node by node, each node's in
        the order of its method's parameters (``g.inputs`` lists them); a tensor given twice
        counts once. Inputs must match the graph's geometry (shape, strides, dtype, device).
        Torch tensors and DLPack arrays (CuPy) are taken; outputs come back as the inputs' kind.
        Runs on the current torch stream unless ``stream=`` is given; safe in CUDA-graph capture.

        Args:
            *args: the inputs, positionally, or one dict from input name (or handle) to tensor.
            handle: a handle to run with (its stream, unless ``stream`` is given).
            stream: a torch stream or a raw ``cudaStream_t`` int to run on.
            out: tensors to write the outputs into: one tensor, a sequence in output order, or a
                dict by output name; new tensors otherwise.
            workspace: a device buffer of at least ``get_workspace_size()`` bytes for cuDNN's
                workspace; allocated here otherwise.

        Returns:
            The one output, or a tuple of the outputs in node order (``(O, Stats)``,
            ``(dQ, dK, dV)``, ...): ``g.outputs``. An output a tensor of the caller's receives
            (``dSink_token=t``, ``dBias=t``, ``rng_dump=t``) is written into it, not returned.

        Raises:
            ShapeMismatchError: an input missing, extra, or of another geometry than the
                graph's (named, before any GPU work).
            GraphStateError: the graph's plans were released (the interpreter is exiting).
            ValidationError: a keyword the call does not take (named).
        """
        if unknown:  # named as the ops and the constructor name theirs, not Python's TypeError
            raise ValidationError(
                [f"{name}: not a keyword of a graph's call (handle, stream, out, workspace)" for name in unknown],
                context=self.name,
            )
        if not self.recording.built:
            self.build()
        runner = self._runner
        if runner is None:
            raise GraphStateError(f"{self.name}: this graph's plans were released (the interpreter is exiting)")
        if self._io is not None:
            return self._io.call(
                lambda given, given_out: runner((given,), handle, stream, given_out, workspace), args, out
            )
        return runner(args, handle, stream, out, workspace)

    def set_io_tuples(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        """The frontend's wrapper call: the order in which positional calls take the inputs and
        return the outputs, as ``Graph(inputs=, outputs=)`` gives it (``frontend/declared.py``).

        Args:
            inputs: names (``"SDPA::q"`` or a ``set_name``), uids, graph tensors, or, before the
                build, the torch tensors given to the ops.
            outputs: likewise (``"SDPA::O"``, ``"SDPA::Stats"``, ...).

        Raises:
            ValidationError: not lists, or an entry that names no input or produced output.
        """
        # After the build the outputs keep the layout they were built with (this library's Graph:
        # q's); Graph(inputs=, outputs=) declares them before, where unset ones are packed.
        if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)):
            raise ValidationError(
                [
                    f"set_io_tuples: inputs and outputs must be lists or tuples (got {type(inputs).__name__}, "
                    f"{type(outputs).__name__})"
                ],
                context=self.name,
            )
        self.declared = (list(inputs), list(outputs))
        if not self.recording.built:  # taken at the build, as Graph(inputs=, outputs=) is
            self.recording.key.keyed = False  # the recording's key did not include them: built in full
            self.recording.frontend_rules = True
            return
        self._io = DeclaredIO(self.recording, *self.declared, context=self.name)

    def run_roles(self, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        """Run a one-node graph on tensors named by role, unchecked (``Runner.run_roles``): the
        library's packed (varlen) path, which checks geometry itself and serves every token
        count of a batch geometry with one graph."""
        if not self.recording.built:
            self.build()
        if self._runner is None:
            raise GraphStateError(f"{self.name}: this graph's plans were released (the interpreter is exiting)")
        self._runner.run_roles(inputs, outputs)

    # ---- the frontend's build steps, plan helpers and run (frontend/) ------------------------
    # The frontend builds in steps; here every step is one build(), so frontend code runs unchanged.

    def validate(self) -> Graph:
        """The frontend's first build step: builds the graph (all steps are one ``build()`` here)."""
        return self.build()

    def build_operation_graph(self) -> Graph:
        """The frontend's second build step: builds the graph."""
        return self.build()

    def create_execution_plans(self, *heuristics: Any) -> Graph:
        """The frontend's plan step: the modes are checked, the graph built (mode A, FALLBACK behind)."""
        options.check_heuristics(heuristics, self.name)
        return self.build()

    def check_support(self, *args: Any) -> Graph:
        """The frontend's support check: builds the graph (``UnsupportedError`` lists the reasons)."""
        return self.build()

    def build_plans(self, *args: Any, **kwargs: Any) -> Graph:
        """The frontend's last build step: builds; with ``build_plan_policy.ALL`` each candidate plan is
        built when first run by index."""
        options.check_policies(args, kwargs, self.name)
        return self.build()

    def get_workspace_size(
        self, handle: Any = None, override_uids: Any = None, override_shapes: Any = None, override_strides: Any = None
    ) -> int:
        """The largest workspace, in bytes, of the graph's plans (allocated when ``execute`` gets none)."""
        return plans.workspace_size(self)

    def serialize(self, *, as_bytes: bool = False, include_kernels: bool = True) -> Any:
        """The built graph as bytes ``deserialize`` reads back (``frontend/serialized.py``); a list of
        byte values unless ``as_bytes``, as the frontend returns. ``include_kernels`` is accepted.
        A tensor given to receive an output (``dSink_token=t``) is not in the bytes: the read-back
        graph returns that output."""
        data = serialized.serialize(self)
        return data if as_bytes else list(data)

    def deserialize(self, *args: Any, **kwargs: Any) -> None:
        """``deserialize(data)`` or ``deserialize(handle, data, enforce_precompiled=False)``, into
        an empty graph: it is built from what ``serialize`` wrote, with nothing planned again."""
        handle, data = serialized.arguments(args, kwargs)
        self.handle = handle if self.handle is None else self.handle
        self._runner = serialized.deserialize(self, data)
        lifecycle.track_releasable(self)

    def get_execution_plan_count(self) -> int:
        """How many candidate plans the graph has: 0 until it is built."""
        return plans.count(self.recording)

    def get_plan_name_at_index(self, index: int) -> str:
        """The engine name of candidate plan ``index`` of a one-node graph."""
        return plans.name_at(self, index)

    def get_workspace_size_plan_at_index(
        self,
        index: int,
        handle: Any = None,
        override_uids: Any = None,
        override_shapes: Any = None,
        override_strides: Any = None,
    ) -> int:
        """The workspace, in bytes, of candidate plan ``index`` of a one-node graph."""
        return plans.workspace_at(self, index)

    def execute_plan_at_index(
        self,
        variant_pack: Mapping[Any, Any],
        workspace: Any = None,
        index: int = 0,
        handle: Any = None,
        *,
        tensor_uids: Any = None,
    ) -> None:
        """``execute`` with candidate plan ``index`` (built on first use) instead of the chosen one."""
        pack = ordered_pack(variant_pack, tensor_uids, self.name)
        execute_at_index(self, self._other_runners(), pack, workspace, index, handle)

    def execute(
        self,
        variant_pack: Mapping[Any, Any],
        workspace: Any = None,
        handle: Any = None,
        override_uids: Any = None,
        override_shapes: Any = None,
        override_strides: Any = None,
        tensor_uids: Any = None,
        *,
        stream: Any = None,
    ) -> None:
        """The frontend's run: every tensor of the graph, inputs and outputs, given in one dict.

        Args:
            variant_pack: every input and every produced output of the graph, keyed by handle,
                name or uid; outputs are written in place. ``None`` keys are ignored, as are
                virtual outputs (bindings the graph does not use, as in the frontend). With
                ``tensor_uids``: the buffers alone, a list in their order.
            workspace: a device buffer of at least ``get_workspace_size()`` bytes, or None.
            handle: a handle to run with.
            override_uids: with ``is_override_shape_enabled=True``: the uids whose dims and
                strides this run overrides.
            override_shapes: their dims, in ``override_uids``' order.
            override_strides: their strides, likewise.
            tensor_uids: the frontend's ordered form: one distinct uid per buffer of
                ``variant_pack`` (a list or tuple).
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
        overrides = (override_uids, override_shapes, override_strides)
        pack = ordered_pack(variant_pack, tensor_uids, self.name)
        execute_pack(self, self._other_runners(), pack, workspace, handle, overrides, stream)

    def _other_runners(self) -> dict[Hashable, Any]:
        return self.__dict__.setdefault("_others", {})  # by plan index or override; most graphs never need it

    @property
    def problems(self) -> list[AttentionProblem]:
        """The ``AttentionProblem`` of each node (what its plan was built for), once built."""
        return [node.problem for node in self.nodes if node.problem is not None]

    @property
    def outputs(self) -> list[OutputHandle]:
        """The output handles a call returns, in order: those produced (not marked
        ``set_output(False)``) but for those a tensor of the caller's receives (``dSink_token=t``)."""
        return [h for node in self.nodes for h in node.outputs.values() if h.is_output and h.receiver is None]

    def nbytes(self) -> int:
        """Bytes of device and host memory this graph's plans hold (workspaces, prepared buffers)."""
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
    """``Graph`` with the frontend's rules, for code written against ``cudnn.pygraph``.

    Once any output is marked with ``set_output(True)``, the outputs never marked are virtual
    (not produced, absent from the variant pack); a graph with no output marked produces them
    all. ``io_data_type`` is the type of tensors made without one, never a constraint on the
    others. Takes ``Graph``'s arguments.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16) for _ in range(3))
        g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
        Q, K, V = (g.tensor_like(t, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
        O, _ = g.sdpa(Q, K, V, attn_scale=0.125, use_causal_mask=True)
        O.set_output(True).set_dim(q.shape).set_stride(q.stride())
        g.build([cudnn.heur_mode.A])
        o = torch.empty_like(q)
        g.execute({Q: q, K: k, V: v, O: o}, workspace=None)
        ```
    """

    virtual_outputs = True


@contextmanager
def graph(
    handle: Any,
    name: str = "cudnn_graph",
    io_data_type: Any = data_type.HALF,
    intermediate_data_type: Any = data_type.FLOAT,
    compute_data_type: Any = data_type.FLOAT,
    **graph_kwargs: Any,
) -> Iterator[tuple[pygraph, list]]:
    """The frontend's ``with cudnn.graph(handle) as (g, _):`` context manager.

    Yields a ``pygraph`` (with the frontend's io/intermediate/compute defaults) and an empty
    list; nothing is built on leaving the block (``cudnn_attn.jit`` builds, or the caller does).

    Args:
        handle: a handle (ours or the frontend's), or None.
        name: the graph's name.
        io_data_type: dtype of tensors made without one; HALF by default, as in the frontend.
        intermediate_data_type: FLOAT only.
        compute_data_type: FLOAT only.
        **graph_kwargs: further ``pygraph`` arguments.

    Yields:
        ``(graph, [])``.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
        with cudnn.graph(cudnn.create_handle()) as (g, _):
            Q = g.tensor(dim=q.shape, stride=q.stride(), name="q")
            O, _ = g.sdpa(Q, Q, Q, use_causal_mask=True)
            O.set_output(True)
        g.build()
        ```
    """
    yield pygraph(name, io_data_type, intermediate_data_type, compute_data_type, handle, **graph_kwargs), []
