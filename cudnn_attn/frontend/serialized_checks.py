"""What ``deserialize`` accepts: a serialized graph's header, checked whole before any of it is used.

A blob is hostile until checked (it may have been damaged on disk or edited): ``header_problems``
checks the JSON's structure (every key, every type), ``typed_problems`` the restored problem's
fields against their annotations, and ``binding_problems`` that a node's tensors are the roles
its problem has, each uid one tensor of one geometry. Each returns lines; the caller raises
them as one ``ValidationError`` naming ``data``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import torch

from ..core.problem import AttentionProblem, TensorSpec
from ..core.score_mod import Expr, ScoreModifier
from ..ops import BACKENDS

HEADER_KEYS = {"name", "nodes"}
NODE_KEYS = {"name", "problem", "backend", "tensors", "runtime", "plan_bytes"}
TENSOR_KEYS = {"uid", "name", "output", "by_value"}
RUNTIME_ROLES = ("dropout_seed", "dropout_offset")  # passed by value: ints
_NAMES = {"TensorSpec": TensorSpec, "ScoreModifier": ScoreModifier, "Expr": Expr}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _keys(value: Any, keys: set[str], where: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: {type(value).__name__}; expected an object"]
    if set(value) != keys:
        return [f"{where}: keys {sorted(map(str, value))}; expected {sorted(keys)}"]
    return []


def header_problems(header: Any) -> list[str]:
    """What is wrong with the header's structure: keys and types, node by node."""
    found = _keys(header, HEADER_KEYS, "header")
    if found:
        return found
    if not isinstance(header["name"], str):
        found.append("header.name: expected a string")
    nodes = header["nodes"]
    if not isinstance(nodes, list) or not nodes:
        return [*found, "header.nodes: expected a non-empty list"]
    for i, entry in enumerate(nodes):
        where = f"node {i}"
        lines = _keys(entry, NODE_KEYS, where)
        if lines:
            found += lines
            continue
        if not isinstance(entry["name"], str):
            found.append(f"{where}.name: expected a string")
        if not isinstance(entry["problem"], dict):
            found.append(f"{where}.problem: expected an object")
        if entry["backend"] not in BACKENDS:
            found.append(f"{where}.backend: {entry['backend']!r}; expected one of {', '.join(map(repr, BACKENDS))}")
        if not _is_int(entry["plan_bytes"]) or entry["plan_bytes"] < 0:
            found.append(f"{where}.plan_bytes: expected an int >= 0")
        runtime = entry["runtime"]
        if not isinstance(runtime, dict) or not all(k in RUNTIME_ROLES and _is_int(v) for k, v in runtime.items()):
            found.append(f"{where}.runtime: expected an object of {', '.join(RUNTIME_ROLES)} ints")
        tensors = entry["tensors"]
        if not isinstance(tensors, dict) or not tensors:
            found.append(f"{where}.tensors: expected a non-empty object")
            continue
        for role, tensor in tensors.items():
            found += _keys(tensor, TENSOR_KEYS, f"{where}.tensors.{role}") or _tensor_problems(tensor, where, role)
    return found


def _tensor_problems(tensor: dict[str, Any], where: str, role: str) -> list[str]:
    uid, name, flags = tensor["uid"], tensor["name"], (tensor["output"], tensor["by_value"])
    if _is_int(uid) and uid >= 0 and isinstance(name, str) and all(isinstance(f, bool) for f in flags):
        return []
    return [f"{where}.tensors.{role}: expected uid (int >= 0), name (string), output and by_value (bools)"]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, localns=_NAMES)


def typed_problems(data: Any, hint: Any, where: str) -> list[str]:
    """Where the JSON ``data`` of a problem (or of one of its fields) is not of the field's
    annotated type: every object with exactly its dataclass's keys, every value of its type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if data is None:
            return [] if len(members) < len(typing.get_args(hint)) else [f"{where}: missing"]
        if len(members) > 1:  # a number that may be an int or a float
            ok = isinstance(data, (int, float)) and not isinstance(data, bool)
            return [] if ok else [f"{where}: {type(data).__name__}; expected a number"]
        return typed_problems(data, members[0], where)
    if origin is tuple:
        if not isinstance(data, list):
            return [f"{where}: {type(data).__name__}; expected a list"]
        item = typing.get_args(hint)[0]
        return [line for i, v in enumerate(data) for line in typed_problems(v, item, f"{where}[{i}]")]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        fields = {f.name for f in dataclasses.fields(hint)}
        lines = _keys(data, fields, where)
        if lines:
            return lines
        hints = _hints(hint)
        for name in sorted(fields):
            lines += typed_problems(data[name], hints[name], f"{where}.{name}")
        return lines
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        known = [m.value for m in hint]
        return [] if isinstance(data, str) and data in known else [f"{where}: {data!r}; expected one of {known}"]
    if hint is torch.dtype:
        named = getattr(torch, data.removeprefix("torch."), None) if isinstance(data, str) else None
        return [] if isinstance(named, torch.dtype) else [f"{where}: {data!r}; expected a torch dtype"]
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(hint)
    if expected is not None:
        ok = isinstance(data, expected) and (hint is bool or not isinstance(data, bool))
        return [] if ok else [f"{where}: {type(data).__name__}; expected {hint.__name__}"]
    return []


def binding_problems(
    problem: AttentionProblem,
    tensors: dict[str, Any],
    runtime: dict[str, int],
    roles: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]],
    seen: dict[int, TensorSpec],
) -> list[str]:
    """What is wrong with a node's tensors. ``roles``: the op's required, other input and output
    roles. A role the op does not have or leaves out, a role the problem has and the tensors
    leave unbound (or the reverse), a uid shared by an output or by inputs of other geometries, an earlier node's uid of
    another geometry or taken again as an output, dropout's seed and offset given both ways or
    not at all. ``seen``: uid -> geometry, of the nodes before; updated here."""
    required, inputs, outputs = roles
    specs = problem.tensor_specs()
    found = [f"{role}: not a tensor of {problem.op.value}" for role in specs if role not in (*inputs, *outputs)]
    found += [f"{role}: missing; {problem.op.value} needs it" for role in required if role not in specs]
    if found:
        return found
    if set(tensors) != set(specs):
        return [f"tensors {sorted(tensors)}; its problem has {sorted(specs)}"]
    # One tensor may fill several input roles of a node (q = k = v; one lengths tensor for Q
    # and K/V; the frontend's THD form's one offsets tensor) where their geometries agree; an
    # output's uid is its own.
    by_uid: dict[Any, list[str]] = {}
    for role, tensor in tensors.items():
        by_uid.setdefault(tensor["uid"], []).append(role)
    for uid, shared in by_uid.items():
        if len(shared) > 1 and (any(role in outputs for role in shared) or len({specs[r] for r in shared}) > 1):
            found.append(f"{', '.join(shared)}: one uid ({uid}) for tensors of another role or geometry")
    for role, tensor in tensors.items():
        earlier = seen.get(tensor["uid"])
        if earlier is not None and (earlier != specs[role] or role in outputs):
            found.append(f"{role}: uid {tensor['uid']} is another tensor of the graph")
    seen.update({t["uid"]: specs[role] for role, t in tensors.items()})
    for role in RUNTIME_ROLES:
        given = (role in runtime) + (role in specs)
        if given != (1 if problem.options.has_dropout else 0):
            found.append(f"{role}: given {given} times; expected once with dropout, else not at all")
    return found
