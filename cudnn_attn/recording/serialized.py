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

import json
from typing import Any

from ..core.problem import Op
from ..core.restore import problem_from_signature
from ..core.roles import BACKWARD_OUTPUTS, FORWARD_OUTPUTS, FP8_AMAXES, FP8_BACKWARD_AMAXES, ROLES, offset_role
from ..errors import GraphStateError, UnsupportedError, ValidationError
from ..plan_store import signature
from ..runtime import planner
from ..runtime.runner import Runner
from .assembly import INPUTS
from .build import positional_inputs
from .handles import InputHandle, OutputHandle
from .keywords import Parsed
from .node import Node

MAGIC = b"cudnn_attn.graph/1\n"


def serialize(graph: Any) -> bytes:
    graph.build()
    nodes, blobs = [], []
    for node in graph.nodes:
        if node.backend is None or node.problem is None:
            raise GraphStateError(f"{graph.name}: this graph's plans were released; nothing to serialize")
        blob = planner.to_blob(node.backend, node.plan)
        tensors = {
            role: {
                "uid": h.get_uid(),
                "name": h.name,
                "output": isinstance(h, OutputHandle) and h.is_output,
                "by_value": h.is_pass_by_value,
            }  # fmt: skip
            for role, h in {**node.inputs, **node.outputs}.items()
            if h.spec is not None
        }
        nodes.append({"name": node.name, "problem": signature(node.problem), "backend": node.backend,
                      "tensors": tensors, "runtime": node.runtime, "plan_bytes": len(blob)})  # fmt: skip
        blobs.append(blob)
    header = json.dumps({"name": graph.name, "nodes": nodes}).encode()
    return MAGIC + len(header).to_bytes(8, "little") + header + b"".join(blobs)


def deserialize(graph: Any, data: Any) -> Runner:
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
    by_uid: dict[int, Any] = {}
    for index, entry in enumerate(header["nodes"]):
        problem = problem_from_signature(entry["problem"])
        if entry["backend"] == "cudnn" and not problem.device.startswith("cuda"):
            raise UnsupportedError([f"node {entry['name']}: a cuDNN plan on {problem.device}"], context=graph.name)
        try:
            planned = planner.restore(problem, entry["backend"], blobs[index])
        except UnsupportedError:
            raise
        except Exception as error:  # the frontend's own refusal: another GPU architecture or cuDNN
            raise UnsupportedError([f"node {entry['name']}: cuDNN cannot load this plan here: {error}"],
                                   context=graph.name) from error  # fmt: skip
        op = problem.op
        node = Node(op=op, name=entry["name"], positional=_positional(op, problem.is_fp8))
        node.problem, node.plan, node.backend, node.fp8 = problem, planned.plan, planned.backend, problem.is_fp8
        node.parsed = Parsed(problem.options, True, problem.max_seq_len_q, problem.max_seq_len_kv,
                             runtime=dict(entry["runtime"]))  # fmt: skip
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


def _split(raw: bytes) -> tuple[dict[str, Any], list[bytes]]:
    if not raw.startswith(MAGIC):
        raise ValidationError(["data: not a graph serialized by cudnn_attn (a frontend plan blob needs import cudnn)"])
    start = len(MAGIC) + 8
    size = int.from_bytes(raw[len(MAGIC) : start], "little")
    try:
        header = json.loads(raw[start : start + size])
        blobs, at = [], start + size
        for entry in header["nodes"]:
            blobs.append(raw[at : at + entry["plan_bytes"]])
            at += entry["plan_bytes"]
    except (ValueError, KeyError, TypeError):
        raise ValidationError(["data: a truncated or damaged serialized graph"]) from None
    if at != len(raw):
        raise ValidationError(["data: a truncated or damaged serialized graph"])
    return header, blobs


def _outputs(op: Op) -> tuple[str, ...]:
    return (*FORWARD_OUTPUTS, *FP8_AMAXES) if op is Op.FORWARD else (*BACKWARD_OUTPUTS, *FP8_BACKWARD_AMAXES)


def _positional(op: Op, fp8: bool) -> tuple[str, ...]:
    return INPUTS[op, fp8]
