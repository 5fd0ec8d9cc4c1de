"""``ops.torch``: torch's own attention kernels as a backend. ``call`` (one call of torch's SDPA
signature, as the dispatch reads it), ``reasons`` (why each engine passes a call over),
``kernel`` (torch's SDPA kernel running a call), ``cudnn_op`` (torch's cuDNN attention op, for the
training calls it serves), ``backend`` (the ``Backend`` face: plain forward problems of a
``Graph``). Nothing is re-exported here.
"""
