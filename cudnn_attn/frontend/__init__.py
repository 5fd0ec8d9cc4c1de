"""``cudnn_attn.frontend``: the cuDNN frontend's dialect, what code written for ``import cudnn``
needs beyond recording and building a graph.

``compat`` (the module-level spellings: enums, handles, versions), ``options`` (``pygraph``'s own
parameters, heuristic modes and build policies, checked), ``tensors`` (``graph.tensor`` and
``tensor_like``), ``plans`` (the candidate plans of a one-node graph), ``execute`` (the variant
pack), ``overrides`` (a run's own dims and strides), ``declared`` (the pythonic graph's declared
inputs and outputs), ``serialized`` and ``serialized_checks`` (``serialize``/``deserialize``),
``decorators`` (``jit``, ``graph_cache``); ``port`` names what the wing reads of a graph.
``graph.py`` imports this wing, which imports ``recording/`` and the layers below, never
``graph.py``. Nothing is re-exported here.
"""
