"""``cudnn_attn.functional``: ``cudnn_attn.sdpa``, torch's ``scaled_dot_product_attention`` signature
on prepared runs. ``dispatch`` (``sdpa()``: nested, unbatched, compiling or eager, read top-down),
``eager`` (prepared runs by a flat key; training through an ``autograd.Function``), ``compiled`` (the
``torch.library`` custom ops ``cudnn_attn::sdpa_forward`` / ``cudnn_attn::sdpa_backward``, for
``torch.compile`` only), ``arguments`` (torch-style checks, mask to bias, materialise,
``ARGUMENT_NAMES``), ``nested`` (jagged nested tensors through varlen), ``score_terms`` (sinks,
softcap, window) and ``problems`` (a call as one ``AttentionProblem``, its prepared run, and its
check as a graph). Which engine runs a call is ``ops/dispatch.py``'s choice. Only
``sdpa`` (and ``_clear_graphs``, which the tests use) is re-exported here; ``cudnn_attn.sdpa`` is the
public door.
"""

from .dispatch import _clear_graphs as _clear_graphs
from .dispatch import sdpa

__all__ = ["sdpa"]
