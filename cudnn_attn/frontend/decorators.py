"""The frontend's decorators: ``graph_cache`` keeps a function's graph by a key of its
arguments, ``jit`` builds the graph a function returns and gives back its tensors' uids."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def graph_cache(key_fn: Callable[..., Any], maxsize: int = 256) -> Callable:
    """The frontend's memo decorator: a function's result kept by a key of its arguments.

    The wrapped function's result is kept under ``key_fn(*args, **kwargs)``, the oldest entry
    dropped past ``maxsize``. The plan cache behind every graph makes it optional here: a graph
    rebuilt per call is a plan-cache hit.

    Args:
        key_fn: maps the wrapped function's arguments to a hashable key.
        maxsize: entries kept at most.

    Returns:
        A decorator.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        @cudnn.graph_cache(key_fn=lambda q: (tuple(q.shape), q.dtype))
        def attention_graph(q):
            with cudnn.Graph() as g:
                g.sdpa(q, q, q, use_causal_mask=True)
            return g

        q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
        assert attention_graph(q) is attention_graph(q.clone())
        ```
    """

    def decorator(func: Callable) -> Callable:
        cache: dict[Any, Any] = {}

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = key_fn(*args, **kwargs)
            if key in cache:
                return cache[key]
            result = func(*args, **kwargs)
            if len(cache) >= maxsize:
                cache.pop(next(iter(cache)))
            cache[key] = result
            return result

        return wrapper

    return decorator


def jit(heur_modes: Any = "A", **kwargs: Any) -> Callable:
    """The frontend's build decorator: builds the graph a function returns.

    The wrapped function returns ``(graph, tensors)``; the graph is built
    (``build(heur_modes)``) unless it has plans already, and ``(graph, uids)`` is returned, the
    uids of ``tensors`` in order (keys of ``execute``'s variant pack).

    Args:
        heur_modes: a ``heur_mode`` or a list of them, accepted (cuDNN mode A, FALLBACK behind).
        **kwargs: the frontend's other options, accepted.

    Returns:
        A decorator.

    Example:
        ```python
        import torch

        import cudnn_attn as cudnn

        @cudnn.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        def attention_graph(q):
            with cudnn.graph(None) as (g, _):
                Q = g.tensor_like(q)
                O, _ = g.sdpa(Q, Q, Q, use_causal_mask=True)
                O.set_output(True).set_dim(q.shape).set_stride(q.stride())
            return g, [Q, O]

        q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
        g, (q_uid, o_uid) = attention_graph(q)
        o = torch.empty_like(q)
        g.execute({q_uid: q, o_uid: o})
        ```
    """
    modes = heur_modes if isinstance(heur_modes, list) else [heur_modes]

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            graph, tensors = func(*args, **kwargs)
            if graph.get_execution_plan_count() <= 0:
                graph.build(modes)
            return graph, [t.get_uid() for t in tensors]

        return wrapper

    return decorator
