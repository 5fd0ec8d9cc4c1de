"""``cudnn_attn.core``: the attention problem, one frozen value, with its rules and its limits; it
imports torch and the package root's ``options`` only, never a backend or a door.
``problem`` (``AttentionProblem``, ``TensorSpec``, ``Op``, ``KVCacheLayout``), ``roles`` (the role
table and each op's positional roles), ``dtypes`` (the ``data_type`` enum, ``to_torch_dtype``,
``FLOATING_IO``, ``FP8``), ``validation`` (everything wrong with a problem), ``bounds`` (run-time
lengths and page indices clamped on the device), ``derived`` (tensors derived once per input
version) and ``synthetic`` (fresh random run tensors for a problem). Nothing is re-exported here:
import the module (the package root re-exports the public names).
"""
