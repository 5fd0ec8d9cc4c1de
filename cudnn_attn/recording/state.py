"""A graph's recording: its nodes, inputs and names, and the calls its ops recorded.

``Graph``'s public methods record here; the build interprets each call (keywords parsed,
tensors bound to input handles) unless an earlier identical recording's build is adopted
(``reuse.py``). Recording never raises for bad input: every problem becomes a line of
``node.errors``, reported together when the graph is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..core.problem import Op, TensorSpec
from ..core.roles import ROLES, offset_role, user_name
from ..errors import GraphStateError, UnsupportedError, ValidationError
from ..runtime import interop
from . import score_mod
from .handles import InputHandle, OutputHandle, TensorHandle
from .key import RecordingKey
from .keywords import MaskKeywords, collect_keywords, flag_true, parse_keywords, stats_requested
from .node import Node
from .ops_table import STATS, OpSpec


class Recording:
    """What one graph has recorded so far. ``options`` (backend, autotune, dtypes) start the key."""

    def __init__(self, name: str, options: tuple, frontend_rules: bool = False):
        self.name = name
        # The frontend's rules (pygraph, the declared Graph): an output whose layout is not set is
        # packed row-major, as the frontend materializes it; one not yet marked is virtual; an
        # omitted attn_scale multiplies by nothing (the library's own Graph takes 1/sqrt(d)).
        self.frontend_rules = frontend_rules
        self.nodes: list[Node] = []
        self.inputs: list[InputHandle] = []  # in creation order; positional order once built
        self.by_identity: dict[int, InputHandle] = {}  # id(argument) -> its handle
        self.names: set[str] = set()
        self.calls: list[tuple[OpSpec, Node, Mapping[str, Any]]] = []  # interpret.interpret_calls reads them
        self.interpreted = False
        self.made: list[InputHandle] = []  # handles made with tensor()/tensor_like(), in order
        self.key = RecordingKey(options)
        self.built = False
        self._output_count = 0
        self.uids: dict[int, Any] = {}  # uid -> its handle
        self.pinned: set[int] = set()  # the uids set with set_uid (the others yield to them)
        self._next_uid = 1

    # ---- names and inputs ------------------------------------------------------------------------

    def unique_name(self, name: str) -> str:
        candidate, n = name, 1
        while candidate in self.names:
            candidate = f"{name}_{n}"
            n += 1
        self.names.add(candidate)
        return candidate

    def claim_name(self, old: str, name: Any) -> None:
        """Rename a handle from ``old`` to ``name`` (raises when ``name`` is taken or not a name)."""
        if not isinstance(name, str) or not name:
            raise ValidationError([f"name: {name!r}; expected a non-empty string"])
        if name != old:
            if name in self.names:
                raise ValidationError([f"name: {name!r} is already used in this graph"])
            self.names.discard(old)
            self.names.add(name)

    def new_uid(self, handle: Any) -> int:
        """A uid for ``handle`` that no tensor of this graph holds (pinned uids are skipped)."""
        while self._next_uid in self.uids:
            self._next_uid += 1
        self.uids[self._next_uid] = handle
        return self._next_uid

    def claim_uid(self, handle: Any, uid: Any) -> None:
        """``handle`` takes ``uid``: an int >= 0 no other tensor of the graph holds."""
        if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
            raise ValidationError([f"{handle.name}.set_uid: {uid!r}; expected an int >= 0"])
        holder = self.uids.get(uid)
        if holder is not None and holder is not handle:
            if uid in self.pinned:
                raise ValidationError([f"{handle.name}.set_uid: uid {uid} is already the uid of {holder.name!r}"])
            # A uid this graph gave on its own yields, as the frontend assigns its own only at build.
            self.uids.pop(uid)
            holder.uid = self.new_uid(holder)
        self.uids.pop(handle.uid, None)
        self.pinned.discard(handle.uid)
        self.uids[uid] = handle
        self.pinned.add(uid)

    def caller_output(self, node: Node, role: str, given: Any) -> None:
        """The frontend's caller-made output (``dBias=``): ``node``'s output ``role`` takes the
        geometry of ``given``. A tensor handle of this graph: ``execute`` finds that output under
        its handle, name or uid. A tensor: every run writes it in place."""
        output = node.outputs[role]
        if isinstance(given, InputHandle) and given.recording is self:
            spec = given.spec
            given.alias_of = output
        else:
            tensor = interop.as_torch(given) if not isinstance(given, TensorHandle) else None
            if tensor is None:
                node.errors.append(f"{node.argument(role)}: {type(given).__name__}; expected a tensor of this graph")
                return
            if not interop.writable(given):
                node.errors.append(f"{node.argument(role)}: a read-only array; it receives an output")
            elif tensor.requires_grad:
                node.errors.append(f"{node.argument(role)}: requires grad; it is written in place (pass t.detach())")
            spec = TensorSpec.of(tensor)
            output.receiver = tensor  # each run writes it, as the caller's torch tensor
        output.dim, output.stride, output.dtype = spec.shape, spec.stride, spec.dtype
        output.marked = output.is_output = True

    def settle_outputs(self) -> None:
        """The frontend's rule: once any output is marked with ``set_output(True)``, the outputs
        never marked are virtual (not produced). A graph where none is marked produces them all."""
        outputs = [h for node in self.nodes for h in node.outputs.values()]
        if any(h.marked for h in outputs):
            for h in outputs:
                if h.marked is None:
                    h.is_output = False

    def new_input(self, spec: TensorSpec, name: str, template: torch.Tensor | None, role: str = "") -> InputHandle:
        handle = InputHandle(self, self.unique_name(name), spec, role or name, template)
        self.inputs.append(handle)
        return handle

    def made_input(self, spec: TensorSpec, name: str, template: torch.Tensor | None) -> InputHandle:
        """An input made with ``Graph.tensor``/``tensor_like`` (numbered among those)."""
        handle = self.new_input(spec, name, template)
        handle.made_index = len(self.made)
        self.made.append(handle)
        return handle

    def check_open(self, what: str) -> None:
        if self.built:
            raise GraphStateError(f"{what}: the graph is already built; record ops inside the `with` block")

    # ---- recording calls -------------------------------------------------------------------------

    def record_call(self, spec: OpSpec, arguments: Mapping[str, Any]) -> Node:
        """A new node with its output handles (``spec``'s, those the call asks for); the call,
        ``arguments`` by parameter name, kept for the build to interpret."""
        if self.built:  # tested here, not by a call: a graph made per call records on its hot path
            self.check_open(spec.name)
        self.key.add(self, spec.name, spec.arguments, arguments)
        op, name = spec.op, arguments["name"]
        count = sum(1 for n in self.nodes if n.op is op)
        node = Node(op=op, name=op.value if count == 0 else f"{op.value}_{count}", positional=spec.inputs, fp8=spec.fp8)
        if name is not None:
            if isinstance(name, str):
                node.name = name
            else:
                node.errors.append(f"name: {name!r}; expected a string")
        self.nodes.append(node)
        for output in spec.outputs:
            given = arguments[output.given] if output.given is not None else None
            if given is not None:
                made = True
            elif output.flag == STATS:  # its errors are reported at build
                made = stats_requested(arguments["is_inference"], arguments["generate_stats"], [])
            elif output.flag is not None:
                made = flag_true(arguments[output.flag])
            else:
                made = output.given is None
            if made:
                self.new_output(node, output.role)
            if given is not None:
                self.caller_output(node, output.role, given)
        # Kept without the method's ``self`` (a graph holding itself until built); a copy, as a
        # debugger's tracer may write ``locals()``'s dict back into the caller's frame.
        kept = dict(arguments)
        kept.pop("self", None)
        self.calls.append((spec, node, kept))
        return node

    def operand_dims(self, node: Node) -> dict[str, tuple[list[int], torch.dtype | None]]:
        """The dims and dtype of ``node``'s q, k and v: as built, or as its call recorded them."""
        if node.problem is not None:
            built = {role: getattr(node.problem, role) for role in ("q", "k", "v")}
            return {role: (list(spec.shape), spec.dtype) for role, spec in built.items() if spec is not None}
        for _, recorded, arguments in self.calls:
            if recorded is node:
                found = {role: _dims_of(arguments.get(role)) for role in ("q", "k", "v")}
                return {role: dims for role, dims in found.items() if dims is not None}
        return {}

    def new_output(self, node: Node, role: str, name: str | None = None) -> OutputHandle:
        base = ROLES[role].output or role
        unique = self.unique_name(name or (base if len(self.nodes) == 1 else f"{node.name}::{base}"))
        handle = OutputHandle(self, unique, node, role, self._output_count)
        self._output_count += 1
        node.outputs[role] = handle
        return handle

    def forget_tensors(self) -> None:
        """Built: templates only served the build-time checks; holding them would keep the first
        call's tensors alive for as long as the graph is cached."""
        for handle in [*self.inputs, *self.made]:
            handle.template = None
        for node in self.nodes:  # the keyword tensors (bias, lengths, sinks) bound as inputs
            if node.parsed is not None:
                node.parsed.tensors.clear()
        self.by_identity.clear()
        self.key.forget()

    # ---- interpreting calls ----------------------------------------------------------------------

    def bind(self, node: Node, role: str, value: Any) -> None:
        """Record ``value`` as ``node``'s input ``role``: a handle, a template tensor or a DLPack array."""
        if value is None:
            return
        if isinstance(value, TensorHandle):
            if value.recording is not self:
                node.errors.append(f"{node.argument(role)}: a tensor handle of another graph")
            else:
                node.inputs[role] = value  # type: ignore[assignment]
                if isinstance(value, OutputHandle):
                    value.consumed = True
            return
        handle = self.by_identity.get(id(value))
        if handle is None:
            tensor = interop.as_torch(value)
            if tensor is None:
                node.errors.append(
                    f"{node.argument(role)}: {type(value).__name__}; expected a tensor (torch, or any DLPack array)"
                )
                return
            if tensor.is_nested:  # its ragged dim has no stride a graph tensor could hold
                node.errors.append(
                    f"{node.argument(role)}: a nested tensor; a graph's tensors are dense (ragged sequences: "
                    "sequence lengths with padding or ragged offsets; cudnn_attn.sdpa takes nested tensors)"
                )
                return
            handle = self.new_input(TensorSpec.of(tensor), node.argument(role), tensor, role)
            self.by_identity[id(value)] = handle
        node.inputs[role] = handle

    def bind_call(
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
            self.bind(node, role, value)
        if isinstance(keywords, MaskKeywords) and (
            keywords.score_mod is not None or keywords.score_mod_bprop is not None
        ):
            self._trace_score_mod(node, keywords, method)

    def _trace_score_mod(self, node: Node, keywords: MaskKeywords, method: str) -> None:
        """The node's score modifier, traced; the graph tensors it reads become its score inputs.
        Sequence lengths given beside it bound the scores as the padding mask does (cuDNN's matmuls
        stop at them), so the problem says padding."""
        assert node.parsed is not None
        if keywords.score_mod_bprop is not None and node.op is Op.FORWARD:
            node.errors.append(f"score_mod_bprop: not a keyword of {method}; sdpa_backward takes it")
            return
        try:
            modifier, inputs = score_mod.trace(keywords.score_mod, keywords.score_mod_bprop, self)
        except ValidationError as error:
            node.errors.extend(error.problems)
            return
        except UnsupportedError as error:
            node.parsed.unsupported.extend(error.problems)
            return
        node.parsed.score_mod = modifier
        for i, value in enumerate(inputs):
            self.bind(node, f"score_input_{i}", value)
        if "seq_len_q" in node.inputs or "seq_len_kv" in node.inputs:
            node.parsed.options = dataclasses.replace(node.parsed.options, padding=True)

    def bind_paged(self, node: Node, table_k: Any, table_v: Any, max_seq_len_kv: Any, layout: Any) -> None:
        node.paged = True
        self.bind(node, "page_table_k", table_k)
        self.bind(node, "page_table_v", table_v)
        node.kv_cache_layout = layout
        assert node.parsed is not None, "bound after the keywords are parsed"
        if max_seq_len_kv is not None:
            if isinstance(max_seq_len_kv, bool) or not isinstance(max_seq_len_kv, int) or max_seq_len_kv < 1:
                node.errors.append(f"max_seq_len_kv: {max_seq_len_kv!r}; expected an int >= 1")
            else:
                node.parsed.max_seq_len_kv = max_seq_len_kv


def bind_offsets(node: Node) -> None:
    """The ragged offsets set on the node's tensors (``set_ragged_offset``, on inputs before the
    op or on its outputs after it) become the node's inputs ``q_offset``, ``o_offset``, ..."""
    for role, handle in [*node.inputs.items(), *node.outputs.items()]:
        offsets = handle.ragged_offset
        if offsets is None:
            continue
        if offset_role(role) in ROLES:
            node.inputs[offset_role(role)] = offsets
        else:
            takers = ", ".join(user_name(r.offsets_of) for r in ROLES.values() if r.offsets_of is not None)
            node.errors.append(
                f"{node.argument(role)}: has ragged offsets (set_ragged_offset); only {takers} take them"
            )


def _dims_of(value: Any) -> tuple[list[int], torch.dtype | None] | None:
    """A recorded operand's dims and dtype: a graph tensor's, or a torch tensor's."""
    if isinstance(value, TensorHandle):
        dims = value.get_dim()
        return None if dims is None else (dims, value.torch_dtype())
    if isinstance(value, torch.Tensor) and not value.is_nested:
        return list(value.shape), value.dtype
    return None
