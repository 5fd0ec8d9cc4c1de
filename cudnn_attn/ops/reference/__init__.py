"""``cudnn_attn.ops.reference``: the pure-PyTorch backend, complete, simple, and the oracle every
cuDNN result is checked against. ``backend`` (``ReferenceBackend``, ``ReferencePlan``, layout
conversions), ``math`` (dense forward and backward), ``fp8`` (FP8 emulation, as cuDNN computes it),
``masks`` (masks and ALiBi as dense tensors) and ``dropout`` (the reference RNG). Nothing is
re-exported here: import the module (``ops`` takes ``ReferenceBackend`` from ``backend``).
"""
