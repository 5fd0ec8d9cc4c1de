"""Tensor handles: what graph ops take and return while a graph is being recorded.

An ``InputHandle`` stands for one of the graph's inputs: a template tensor's geometry, or a
descriptor made with ``Graph.tensor``/``tensor_like``. An ``OutputHandle`` is what an op
returns (O, Stats, dQ, ...); its setters mirror the cuDNN frontend's and chain.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol

import torch

from ..core.dtypes import data_type, to_torch_dtype
from ..core.problem import TensorSpec, contiguous_strides, device_name
from ..errors import GraphStateError, ValidationError, shown


class Keyed(Protocol):
    keyed: bool  # False: the recording cannot be keyed, and is built in full


class RecordingPort(Protocol):
    """What a handle asks of the recording that holds it (``state.Recording``). Named here, so
    that handles need not import the recording, which imports them."""

    @property
    def built(self) -> bool: ...

    @property
    def frontend_rules(self) -> bool: ...

    @property
    def key(self) -> Keyed: ...

    def new_uid(self, handle: Any) -> int: ...

    def claim_uid(self, handle: Any, uid: Any) -> None: ...

    def claim_name(self, old: str, name: Any) -> None: ...

    def check_open(self, what: str) -> None: ...

    def operand_dims(self, node: Any) -> dict[str, tuple[list[int], torch.dtype | None]]: ...


class TensorHandle:
    """Common face of graph tensors: a name and the frontend's getters."""

    def __init__(self, recording: RecordingPort, name: str):
        self.recording = recording  # of the graph it belongs to
        self._name = name
        self.uid = recording.new_uid(self)  # the frontend's tensor uid: a key of execute's variant pack
        self.is_pass_by_value = False
        self.ragged_offset: InputHandle | None = None  # set_ragged_offset: where each sequence starts

    @property
    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def get_name(self) -> str:
        """The tensor's name (the frontend's getter)."""
        return self._name

    def set_name(self, name: str) -> TensorHandle:
        """Rename the tensor (a key of ``execute``'s variant pack and of ``g({name: tensor})``); returns self."""
        self.recording.claim_name(self._name, name)
        self._name = name
        return self

    def get_uid(self) -> int:
        """The tensor's uid, a key of ``execute``'s variant pack."""
        return self.uid

    def set_uid(self, uid: int) -> TensorHandle:
        """Pin this tensor's uid (a variant pack may then be keyed by it); a uid another tensor
        of the graph holds is refused."""
        self.recording.claim_uid(self, uid)
        self.uid = uid
        return self

    def get_is_virtual(self) -> bool:
        """Always False: every tensor here is an input or a produced output."""
        return False

    def set_is_pass_by_value(self, value: bool) -> TensorHandle:
        """Mark a host scalar (read at each run), as the frontend's; returns self."""
        self.is_pass_by_value = bool(value)
        return self

    def get_is_pass_by_value(self) -> bool:
        """Whether the tensor is a host scalar passed by value."""
        return self.is_pass_by_value

    def set_ragged_offset(self, offsets: Any) -> TensorHandle:
        """The frontend's THD form: this 4-D tensor's sequences start at ``offsets`` (an int32/int64
        ``[B + 1, 1, 1, 1]`` graph tensor of element offsets; see ``cudnn_attn.core.ragged``)."""
        if not isinstance(offsets, InputHandle) or offsets.recording is not self.recording:
            raise ValidationError(
                [
                    f"{self._name}.set_ragged_offset: {type(offsets).__name__}; expected a tensor of this graph "
                    "(graph.tensor_like(offsets) or graph.tensor(...)) holding B + 1 element offsets"
                ]
            )
        if self.recording.built:
            raise GraphStateError(f"{self._name}.set_ragged_offset: the graph is already built")
        if offsets.made_index is None or (isinstance(self, InputHandle) and self.made_index is None):
            self.recording.key.keyed = False  # a tensor known by its data alone: the key cannot name it
        self.ragged_offset = offsets
        return self

    def get_ragged_offset(self) -> InputHandle | None:
        """The offsets tensor ``set_ragged_offset`` gave, or None."""
        return self.ragged_offset

    @property
    def spec(self) -> TensorSpec | None:
        """The tensor's geometry: shape, strides, dtype, device."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The tensor's dims (an output's once the graph is built)."""
        spec = self.spec
        return None if spec is None else spec.shape

    def get_dim(self) -> list[int] | None:
        """The tensor's dims as a list (the frontend's getter)."""
        shape = self.shape
        return None if shape is None else list(shape)

    def get_stride(self) -> list[int] | None:
        """The tensor's strides as a list."""
        spec = self.spec
        return None if spec is None else list(spec.stride)

    def get_data_type(self) -> torch.dtype | data_type | None:
        """The tensor's torch dtype; in the frontend's graphs (``pygraph``) its ``data_type``
        member, as the frontend answers (code compares it with ``cudnn.data_type.HALF``)."""
        return self._answered(self.torch_dtype())

    def torch_dtype(self) -> torch.dtype | None:
        """The tensor's torch dtype, in every graph."""
        spec = self.spec
        return None if spec is None else spec.dtype

    def _answered(self, dtype: torch.dtype | None) -> torch.dtype | data_type | None:
        if dtype is None or not self.recording.frontend_rules:
            return dtype
        try:
            return data_type.from_torch(dtype)
        except ValueError:  # a dtype no member stands for: as it is
            return dtype

    def __repr__(self) -> str:
        spec = self.spec
        return f"<{type(self).__name__} {self._name}: {spec.describe() if spec else 'geometry set at build'}>"


class InputHandle(TensorHandle):
    """One graph input: a template tensor's geometry, or a descriptor made with ``Graph.tensor``.

    ``role`` is the op argument it first fed (q, k, attn_bias, ...). Its setters describe the
    tensors later runs pass; they may be called until the graph is built.

    Example:
        ```python
        import cudnn_attn as cudnn

        g = cudnn.pygraph()
        q = g.tensor(dim=(1, 2, 16, 64), stride=(2048, 64, 128, 1), data_type=cudnn.data_type.HALF, name="q")
        q.set_stride((2048, 1024, 64, 1))  # BHSD after all
        assert q.get_dim() == [1, 2, 16, 64] and q.get_data_type() == cudnn.data_type.HALF
        ```
    """

    def __init__(self, recording: RecordingPort, name: str, spec: TensorSpec, role: str, template: torch.Tensor | None):
        super().__init__(recording, name)
        self._spec = spec
        self.role = role
        self.template = template  # the data of a template tensor, for build-time value checks
        self.made_index: int | None = None  # its place among handles made with tensor()/tensor_like()
        self.alias_of: OutputHandle | None = None  # made by the caller to receive an op's output (dBias=)
        # Whether the strides were given (a tensor's, or stride=/set_stride), not row-major by default.
        self.strides_given = True

    @property
    def spec(self) -> TensorSpec:
        """The input's geometry: shape, strides, dtype, device."""
        return self._spec

    # The frontend's setters on an input: they describe the tensors later runs will pass.

    def set_output(self, is_output: bool = True) -> InputHandle:
        """Frontend code marks the tensors it makes to receive an op's output (``dBias=``,
        ``rng_dump=``): the op they are given to makes them outputs; nothing to do here."""
        return self

    def set_dim(self, dim: Any) -> InputHandle:
        """Set the input's dims; returns self. Strides that were given stay as they are, as the
        frontend's ``set_dim`` leaves them (a BSHD tensor described with BHSD dims keeps its
        layout); default ones, or ones of another rank, become the new dims' row-major strides."""
        self.recording.check_open(f"{self._name}.set_dim")
        shape = int_tuple(dim, f"{self._name}.set_dim")
        kept = self.strides_given and len(shape) == len(self._spec.shape)
        strides = self._spec.stride if kept else contiguous_strides(shape)  # a default follows the dims
        self._spec = TensorSpec(shape, strides, self._spec.dtype, self._spec.device)
        return self

    def set_stride(self, stride: Any) -> InputHandle:
        """Set the input's strides, one per dim; returns self."""
        self.recording.check_open(f"{self._name}.set_stride")
        strides = int_tuple(stride, f"{self._name}.set_stride")
        if len(strides) != len(self._spec.shape):
            raise ValidationError([f"{self._name}.set_stride: {len(strides)} strides for {len(self._spec.shape)} dims"])
        self._spec = TensorSpec(self._spec.shape, strides, self._spec.dtype, self._spec.device)
        self.strides_given = True
        return self

    def set_data_type(self, data_type: Any) -> InputHandle:
        """Set the input's dtype (``data_type`` member or torch dtype); returns self."""
        self.recording.check_open(f"{self._name}.set_data_type")
        try:
            dtype = to_torch_dtype(data_type, f"{self._name}.set_data_type")
        except TypeError as error:
            raise ValidationError([str(error)]) from None
        if dtype is not None:
            self._spec = TensorSpec(self._spec.shape, self._spec.stride, dtype, self._spec.device)
        return self


class OutputHandle(TensorHandle):
    """An op's output (O, Stats, dQ, ...); its setters may be called until the graph is built.

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
        with cudnn_attn.Graph() as g:
            o, stats = g.sdpa(q, q, q, generate_stats=True)
            o.set_name("o").set_output(True)
            stats.set_output(False)  # virtual: not produced
        out = g(q)  # only O; a tensor given three times is one input
        ```
    """

    def __init__(self, recording: RecordingPort, name: str, node: Any, port: str, index: int = 0):
        super().__init__(recording, name)
        self.node = node
        self.index = index  # its place among the graph's outputs, in creation order
        self.port = port  # the role in the problem: "o", "stats", "d_q", ...
        self.is_output = True
        self.marked: bool | None = None  # what set_output said, if it was called
        self.consumed = False  # an input of a later node: computed even where virtual
        self.dim: tuple[int, ...] | None = None
        self.stride: tuple[int, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.built_spec: TensorSpec | None = None  # known once the graph is built
        # The caller's tensor given to receive it (``dSink_token=t``): written in place, not returned.
        self.receiver: torch.Tensor | None = None

    @property
    def spec(self) -> TensorSpec | None:
        """The output's geometry, known once the graph is built (None before)."""
        return self.built_spec

    # Before the build the frontend's getters answer what the setters said, as the frontend's do.

    def get_dim(self) -> list[int] | None:
        """The output's dims: once built, as built; before, as ``set_dim`` said, else (in the
        frontend's graphs) as the frontend reports them; None where none of those says."""
        if self.built_spec is None:
            reported = self._reported()
            return list(self.dim) if self.dim is not None else reported and reported[0]
        return super().get_dim()

    def get_stride(self) -> list[int] | None:
        """The output's strides: once built, as built; before, as ``set_stride`` said, else (in
        the frontend's graphs) packed row-major over its dims, as the frontend reports them."""
        if self.built_spec is None:
            if self.stride is not None:
                return list(self.stride)
            dims = self.get_dim()
            return None if dims is None or self._reported() is None else list(contiguous_strides(tuple(dims)))
        return super().get_stride()

    def torch_dtype(self) -> torch.dtype | None:
        """The output's dtype: once built, as built; before, as ``set_data_type`` said, else (in
        the frontend's graphs) as the frontend reports it. ``get_data_type`` answers it."""
        if self.built_spec is None:
            reported = self._reported()
            return self.dtype if self.dtype is not None else reported and reported[1]
        return super().torch_dtype()

    def _reported(self) -> tuple[list[int], torch.dtype | None] | None:
        """What the frontend reports for an output not built (before the build, or left virtual),
        which it infers when the op is recorded: O [B, H, S_q, D_v] in q's type, Stats
        [B, H, S_q, 1] float32, dQ/dK/dV like q/k/v, amaxes [1, 1, 1, 1] float32. None in the
        library's own Graph (its getters answer what the setters said) or where q is not known."""
        if not self.recording.frontend_rules:
            return None
        operands = self.recording.operand_dims(self.node)
        q = operands.get("q")
        if q is None or len(q[0]) != 4:
            return None
        if self.port == "o" and "v" in operands:
            return [*q[0][:-1], operands["v"][0][-1]], q[1]
        if self.port == "stats":
            return [*q[0][:-1], 1], torch.float32
        if self.port in ("grad_q", "grad_k", "grad_v"):
            return operands.get(self.port.removeprefix("grad_"))
        if self.port.startswith("amax_"):
            return [1, 1, 1, 1], torch.float32
        return None

    def get_is_virtual(self) -> bool:
        """Whether the output is not produced: once built, as built; before, as ``set_output``
        said, and in the frontend's graphs an output not yet marked is virtual, as there."""
        if self.recording.built:
            return not self.is_output
        if self.marked is not None:
            return not self.marked
        return self.recording.frontend_rules

    def _check_open(self, what: str) -> None:
        if self.recording.built:
            raise GraphStateError(f"{self._name}.{what}: the graph is already built; set it inside the `with` block")

    def set_output(self, is_output: bool = True) -> OutputHandle:
        """Mark the output produced (True) or virtual (False: not computed unless an op reads it); returns self."""
        self._check_open("set_output")
        self.is_output = self.marked = bool(is_output)
        return self

    def set_dim(self, dim: Any) -> OutputHandle:
        """Check the output's dims against what the op produces, at build; returns self."""
        self._check_open("set_dim")
        self.dim = int_tuple(dim, f"{self._name}.set_dim")
        return self

    def set_stride(self, stride: Any) -> OutputHandle:
        """The output's strides (a layout of its own, e.g. BSHD); returns self."""
        self._check_open("set_stride")
        self.stride = int_tuple(stride, f"{self._name}.set_stride")
        return self

    def set_data_type(self, data_type: Any) -> OutputHandle:
        """The output's dtype (e.g. FP8 O from FP8 inputs); returns self."""
        self._check_open("set_data_type")
        try:
            self.dtype = to_torch_dtype(data_type, f"{self._name}.set_data_type")
        except TypeError as error:
            raise ValidationError([str(error)]) from None
        return self


def int_tuple(value: Any, argument: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints; ints, integral tensors and numpy ints pass; floats (NaN,
    8.5), bools, strings and non-sequences raise ``ValidationError`` naming ``argument``."""
    try:
        items = list(value)
        ints = tuple(operator.index(v) for v in items if not isinstance(v, bool))
    except TypeError:
        items, ints = [None], ()
    if len(ints) != len(items):
        raise ValidationError([f"{argument}: {shown(value)}; expected a sequence of ints"])
    return ints


def ints_or_problem(values: Any, argument: str, problems: list[str]) -> tuple[int, ...] | None:
    """``int_tuple``, its problem appended to ``problems`` (None then) instead of raised."""
    try:
        return int_tuple(values, argument)
    except ValidationError as error:
        problems += error.problems
        return None


def handle_spec(template: TensorHandle) -> TensorSpec:
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
