"""The frontend's run: ``execute(variant_pack)``, every tensor of the graph (inputs and the
outputs it writes in place) given in one dict keyed by handle, name or uid.

A plain pack runs through the graph's own call; a pack with shape overrides runs on the
override's runner (``overrides.py``), and ``execute_plan_at_index`` on a candidate plan's
(``plans.py``). Both are kept in the graph's table of other runners.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from ..errors import ShapeMismatchError, ValidationError, shown
from ..recording.handles import InputHandle
from ..runtime import interop
from .declared import resolve
from .overrides import check_overridden, overridden_runner
from .plans import runner_at
from .port import GraphPort


def ordered_pack(variant_pack: Any, tensor_uids: Any, context: str) -> Any:
    """The frontend's ordered form, ``execute([buffers], ws, tensor_uids=[uids])``, as a pack by
    uid; ``variant_pack`` as it is without ``tensor_uids``."""
    if tensor_uids is None:
        return variant_pack
    problems = []
    if not isinstance(tensor_uids, (list, tuple)) or not all(
        isinstance(u, int) and not isinstance(u, bool) for u in tensor_uids
    ):
        problems.append(f"tensor_uids: {shown(tensor_uids)}; expected a list or tuple of tensor uids (ints)")
    elif len(set(tensor_uids)) != len(tensor_uids):
        twice = sorted({u for u in tensor_uids if tensor_uids.count(u) > 1})
        problems.append(f"tensor_uids: uids {twice} given more than once")
    if not isinstance(variant_pack, (list, tuple)):
        problems.append(
            f"variant_pack: {type(variant_pack).__name__} beside tensor_uids; the ordered form takes the buffers "
            "as a list in tensor_uids' order (or give a dict without tensor_uids)"
        )
    elif not problems and len(variant_pack) != len(tensor_uids):
        problems.append(f"variant_pack: {len(variant_pack)} buffers for {len(tensor_uids)} tensor_uids")
    if problems:
        raise ValidationError(problems, context=context)
    return dict(zip(tensor_uids, variant_pack))


def execute_pack(
    graph: GraphPort,
    runners: dict[Hashable, Any],
    variant_pack: Mapping[Any, Any],
    workspace: Any,
    handle: Any,
    overrides: tuple[Any, Any, Any],
    stream: Any,
) -> None:
    """Run ``graph`` on ``variant_pack``; ``overrides``: ``(override_uids, override_shapes, override_strides)``."""
    found = None
    if any(given is not None for given in overrides):
        graph.build()
        found = overridden_runner(graph, runners, *overrides)
    # Tensors are viewed by memory with the geometry this run checks them against: the override's.
    inputs, outputs = variant_pack_of(graph, variant_pack, found[1] if found is not None else {})
    if found is not None:
        runner, stand_in = found
        check_overridden({**inputs, **outputs}, stand_in, graph.name)
        values, _ = runner.bind(({stand_in[h]: t for h, t in inputs.items()},))
        runner.bind_out(values, {stand_in[h]: t for h, t in outputs.items()})
        runner.run(values, handle, stream, workspace)
        return
    graph(inputs, handle=handle, stream=stream, out=outputs, workspace=workspace)


def execute_at_index(
    graph: GraphPort,
    runners: dict[Hashable, Any],
    variant_pack: Mapping[Any, Any],
    workspace: Any,
    index: Any,
    handle: Any,
) -> None:
    """``execute`` with candidate plan ``index`` (built on first use) instead of the chosen one."""
    runner = runner_at(graph, runners, index)
    inputs, outputs = variant_pack_of(graph, variant_pack, {})
    runner.bind_out(values := runner.bind((inputs,))[0], outputs)
    runner.run(values, handle, None, workspace)


def variant_pack_of(
    graph: GraphPort, variant_pack: Mapping[Any, Any], stand_in: Mapping[Any, Any]
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The pack's inputs and outputs by handle, the graph built; unknown keys and missing outputs
    raise. ``stand_in``: handle -> its stand-in under this run's overrides (its geometry)."""
    if not isinstance(variant_pack, Mapping):
        raise ValidationError([f"variant_pack: {type(variant_pack).__name__}; expected a dict of handle -> tensor"])
    graph.build()
    recording = graph.recording
    inputs: dict[Any, Any] = {}
    outputs: dict[Any, Any] = {}
    unknown: list[str] = []
    read = set(recording.inputs)
    keys: dict[Any, Any] = {}  # handle -> the first key that named it
    for key, value in variant_pack.items():
        handle = resolve(recording, key)
        if handle is None:
            if key is not None:
                unknown.append(f"{key!r}: not a tensor of this graph (keys: handles, names or uids)")
            continue
        if handle in keys:  # by handle and by uid (or name): which one was meant is not known
            first = keys[handle]
            unknown.append(
                f"{handle.name} (uid {handle.get_uid()}): given twice in the variant pack "
                f"(as {_key_text(first)} and as {_key_text(key)})"
            )
            continue
        keys[handle] = key
        # A tensor of the graph no node reads, or a virtual output, is not bound, as in the frontend.
        if handle not in read if isinstance(handle, InputHandle) else not getattr(handle, "is_output", False):
            continue
        if handle.ragged_offset is None:  # a ragged tensor is bound by its memory as it is
            value = interop.same_memory_view(value, stand_in.get(handle, handle).spec)
        (inputs if isinstance(handle, InputHandle) else outputs)[handle] = value
    if unknown:
        raise ShapeMismatchError(unknown, context="execute")
    missing = [h.name for h in graph.outputs if h not in outputs]
    if missing:
        raise ShapeMismatchError(
            [f"{name}: missing from the variant pack (outputs are written in place)" for name in missing]
        )
    return inputs, outputs


def _key_text(key: Any) -> str:
    if isinstance(key, int):
        return f"uid {key}"
    return f"name {key!r}" if isinstance(key, str) else "its handle"
