"""The frontend's ``serialize()`` / ``deserialize()`` for built graphs.

``serialize`` writes what running the graph again needs: each node's problem (its canonical JSON,
``plan_store.signature``), its backend, the uid, name and kind of every tensor it binds, its
by-value dropout seed and offset, and its backend's plan (cuDNN: the frontend's plan blob; the
reference backend: nothing). ``deserialize`` reads that into an empty ``pygraph``: the graph is
built at once, with no validation, lowering or planning, and runs by ``execute`` keyed by uid or
name as the graph it came from. A cuDNN plan loads only where the frontend's does (the same GPU
architecture and cuDNN); elsewhere the error says so.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..core import validation
from ..core.problem import AttentionProblem, Op, TensorSpec
from ..core.restore import problem_from_signature
from ..core.roles import BACKWARD_OUTPUTS, FORWARD_OUTPUTS, FP8_AMAXES, FP8_BACKWARD_AMAXES, ROLES, offset_role
from ..errors import GraphStateError, UnsupportedError, ValidationError
from ..ops.dispatch import runs_on
from ..plan_store import signature
from ..recording.assembly import INPUTS, REQUIRED
from ..recording.build import positional_inputs
from ..recording.handles import InputHandle, OutputHandle
from ..recording.keywords import Parsed
from ..recording.node import Node
from ..runtime import planner
from ..runtime.runner import Runner
from .port import GraphPort
from .serialized_checks import binding_problems, header_problems, typed_problems

# Then a SHA-256 of everything after it, the header's length, the JSON header and the plans.
MAGIC = b"cudnn_attn.graph/2\n"
_FORMAT_1 = b"cudnn_attn.graph/1\n"  # no checksum; written before 0.1.0's release
_DAMAGED = "data: a truncated or damaged serialized graph"


def serialize(graph: GraphPort) -> bytes:
    graph.build()
    recording = graph.recording
    # A caller-made output (dBias=, dSink_token= given a graph tensor) is found by that tensor's uid and name.
    caller = {id(h.alias_of): h for h in [*recording.inputs, *recording.made] if h.alias_of is not None}
    nodes, blobs = [], []
    for node in graph.nodes:
        if node.backend is None or node.problem is None:
            raise GraphStateError(f"{graph.name}: this graph's plans were released; nothing to serialize")
        blob = planner.to_blob(node.backend, node.plan)  # type: ignore[arg-type]  # released: None, as before
        tensors = {
            role: {
                "uid": caller.get(id(h), h).get_uid(),
                "name": caller.get(id(h), h).name,
                "output": isinstance(h, OutputHandle) and h.is_output,
                "by_value": h.is_pass_by_value,
            }
            for role, h in {**node.inputs, **node.outputs}.items()
            if h.spec is not None
        }
        nodes.append(
            {
                "name": node.name,
                "problem": signature(node.problem),
                "backend": node.backend,
                "tensors": tensors,
                "runtime": node.runtime,
                "plan_bytes": len(blob),
            }
        )
        blobs.append(blob)
    header = json.dumps({"name": graph.name, "nodes": nodes}).encode()
    body = len(header).to_bytes(8, "little") + header + b"".join(blobs)
    return MAGIC + hashlib.sha256(body).digest() + body


def deserialize(graph: GraphPort, data: Any) -> Runner:
    """Read ``data`` (``serialize``'s bytes, or the frontend's list of byte values) into ``graph``;
    the runner of its plans is returned."""
    recording = graph.recording
    if recording.nodes or recording.made or recording.built:
        raise GraphStateError(f"{graph.name}.deserialize: reads into an empty graph (a new pygraph())")
    try:
        raw = bytes(data)
    except (TypeError, ValueError):
        raise ValidationError([f"data: {type(data).__name__}; expected the bytes serialize() returned"]) from None
    header, blobs = _split(raw)
    problems = _checked_problems(header)
    by_uid: dict[int, Any] = {}
    for index, (entry, problem) in enumerate(zip(header["nodes"], problems)):
        try:
            planned = planner.restore(problem, entry["backend"], blobs[index])
        except UnsupportedError:
            raise
        except Exception as error:  # the frontend's own refusal: another GPU architecture or cuDNN
            raise UnsupportedError(
                [f"node {entry['name']}: cuDNN cannot load this plan here: {error}"], context=graph.name
            ) from error
        op = problem.op
        node = Node(op=op, name=entry["name"], positional=_positional(op, problem.is_fp8))
        node.problem, node.plan, node.backend, node.fp8 = problem, planned.plan, planned.backend, problem.is_fp8
        node.parsed = Parsed(
            problem.options, True, problem.max_seq_len_q, problem.max_seq_len_kv, runtime=dict(entry["runtime"])
        )
        for role, tensor in entry["tensors"].items():
            handle = by_uid.get(tensor["uid"])
            if handle is None:
                spec = getattr(problem, role)
                if role in ROLES and ROLES[role].output is not None and role in _outputs(op):
                    handle = recording.new_output(node, role, tensor["name"])
                    handle.built_spec, handle.is_output = spec, tensor["output"]
                else:
                    handle = recording.made_input(spec, tensor["name"], None)
                    handle.role, handle.is_pass_by_value = role, tensor["by_value"]
                handle.set_uid(tensor["uid"])
                by_uid[tensor["uid"]] = handle
            if not (isinstance(handle, OutputHandle) and handle.node is node):
                node.inputs[role] = handle
        for role, handle in [*node.inputs.items(), *node.outputs.items()]:  # the runner binds these by memory
            offsets = node.inputs.get(offset_role(role))
            if isinstance(offsets, InputHandle):
                handle.ragged_offset = offsets
        recording.nodes.append(node)
    recording.inputs = positional_inputs(recording.nodes)
    recording.calls, recording.interpreted, recording.built = [], True, True
    return Runner(graph.name, recording.inputs, recording.nodes, graph.handle)


def arguments(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(handle, data)`` of ``deserialize(data)`` or ``deserialize(handle, data, enforce_precompiled=False)``,
    positional or by keyword (``enforce_precompiled`` is accepted)."""
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
    return handle, data


def _split(raw: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """The header and the plans, the checksum checked; ``ValidationError`` for anything else."""
    if raw.startswith(_FORMAT_1):
        raise ValidationError(["data: a graph serialized by an earlier cudnn_attn (format 1); serialize it again"])
    if not raw.startswith(MAGIC):
        raise ValidationError(["data: not a graph serialized by cudnn_attn (a frontend plan blob needs import cudnn)"])
    start = len(MAGIC) + hashlib.sha256().digest_size
    body = raw[start:]
    if len(body) < 8 or hashlib.sha256(body).digest() != raw[len(MAGIC) : start]:
        raise ValidationError([_DAMAGED])
    size = int.from_bytes(body[:8], "little")
    try:
        header = json.loads(body[8 : 8 + size])
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError), or nested past any header
        raise ValidationError([_DAMAGED]) from None
    lines = header_problems(header)
    if lines:
        raise ValidationError([f"data: {line}" for line in lines])
    blobs, at = [], 8 + size
    for entry in header["nodes"]:
        blobs.append(body[at : at + entry["plan_bytes"]])
        at += entry["plan_bytes"]
    if at != len(body):
        raise ValidationError([_DAMAGED])
    return header, blobs


def _checked_problems(header: dict[str, Any]) -> list[AttentionProblem]:
    """Each node's problem, restored and checked as a build would have made it: typed field by
    field, well formed, run by a backend that can hold it, its tensors bound one uid each."""
    problems: list[AttentionProblem] = []
    seen: dict[int, TensorSpec] = {}
    for entry in header["nodes"]:
        where = f"node {entry['name']!r}"
        try:
            lines = typed_problems(entry["problem"], AttentionProblem, "problem")
            problem = problem_from_signature(entry["problem"]) if not lines else None
        except (ValueError, RecursionError) as error:  # RecursionError: a score_mod nested past any traced one
            raise ValidationError([f"data: {where}: {error}"]) from None
        if problem is not None:
            lines = validation.problems(problem)
        if problem is not None and not lines and not runs_on(entry["backend"], problem.device):
            lines = [f"a {entry['backend']} plan on {problem.device}"]
        if problem is not None and not lines:
            op, fp8 = problem.op, problem.is_fp8
            roles = (REQUIRED[op, fp8], INPUTS[op, fp8], _outputs(op))
            lines = binding_problems(problem, entry["tensors"], entry["runtime"], roles, seen)
        if lines or problem is None:
            raise ValidationError([f"data: {where}: {line}" for line in lines])
        problems.append(problem)
    return problems


def _outputs(op: Op) -> tuple[str, ...]:
    return (*FORWARD_OUTPUTS, *FP8_AMAXES) if op is Op.FORWARD else (*BACKWARD_OUTPUTS, *FP8_BACKWARD_AMAXES)


def _positional(op: Op, fp8: bool) -> tuple[str, ...]:
    return INPUTS[op, fp8]
