"""Every use of the cuDNN frontend's private internals, in one adapter.

The library binds buffers through the frontend's native ordered executor, reads which
plan the heuristics selected and makes handles without the frontend's device probe; all
live behind underscore names that may change between frontend versions (the version is
part of every plan's key). A frontend upgrade touches this file alone; when anything is
not as expected, callers fall back to public calls.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("cudnn_attn.cudnn")


def new_handle(device_index: int) -> Any:
    """A new ``cudnn.Handle`` on the current device (the caller makes ``device_index``
    current), as ``cudnn.create_handle()`` makes it but without its device probe.

    ``create_handle`` asks the frontend's driver layer which device is current, and the first
    such question in a process imports the CUDA driver's Python bindings and initialises them
    (about 20 ms on an H100 host where torch has not imported them: the largest part of a cold
    start with a warm plan store). The caller knows the device.
    """
    import cudnn

    native = getattr(cudnn, "_pybind_module", None)
    create, stream_of, wrap = (
        getattr(native, "create_handle", None),
        getattr(native, "get_stream", None),
        getattr(cudnn, "Handle", None),
    )
    if create is None or stream_of is None or not isinstance(wrap, type):
        return cudnn.create_handle()
    raw = create()
    try:
        return wrap(raw, device_index, stream_of(raw))
    except (TypeError, ValueError, AttributeError) as error:  # another Handle: give this one back, ask publicly
        log.debug("handle wrapping unavailable (%s); using cudnn.create_handle", error)
        destroy = getattr(native, "_raw_destroy_handle", None)
        if destroy is not None:
            destroy(raw)
        return cudnn.create_handle()


def selected_plan_name(graph: Any) -> str:
    """The name of the plan the heuristics selected for a built graph."""
    try:
        return str(graph.get_plan_name_at_index(graph._plan_index))
    except Exception:
        return "heuristic"


def native_executor(graph: Any) -> tuple | None:
    """What the frontend's ``execute(buffers, tensor_uids=...)`` resolves on every call for a
    backend plan, resolved once: its native ordered reader and the plan's index.

    These are the frontend's internals (this frontend version is part of every plan's key);
    when anything is not as expected, None sends calls through the public ``execute``.
    """
    try:
        if graph.selected_engine is not None:  # a python-engine plan: the public path handles it
            return None
        lowered = graph._lowered_graph
        schema = graph._prepare_ordered_binding_schema()
        if lowered is None or schema is None:
            return None
        config = graph._materialize_backend_plan(graph._plan_index) if graph._plans else None
        plan_index = -1 if config is None or config.cpp_index is None else config.cpp_index

        def finish(schema: Any, result: Any, workspace: Any, handle: int, index: int) -> None:
            pack = graph._finish_ordered(schema, result, workspace, None)
            lowered._execute_ordered_pack(pack.native, pack.workspace, handle, index)

        return (lowered._execute_ordered, finish, schema, graph._data_bindings, plan_index)
    except (AttributeError, TypeError, IndexError) as error:
        log.debug("native executor unavailable (%s); using the public execute", error)
        return None


def callback_lowering(graph: Any) -> Any | None:
    """The tensor-lowering function of the lowering that handed ``graph`` to a callback (the
    frontend 1.32's shim keeps it as ``_lower``; one per lowering, shared by every callback it
    wraps), or None where the callback was handed something else."""
    return getattr(graph, "_lower", None)


def forget_lowered_graph(lowering: Any) -> None:
    """Empty the cell of a tensor-lowering function that holds its C++ graph (the link that
    closes the frontend's cycle: C++ graph -> callback -> lowering function -> C++ graph); a
    function of another shape is left as it is."""
    for cell in getattr(lowering, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if type(contents).__name__ == "backend_graph":
            cell.cell_contents = None
