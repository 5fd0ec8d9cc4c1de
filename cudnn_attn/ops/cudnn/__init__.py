"""``cudnn_attn.ops.cudnn``: the cuDNN backend through nvidia-cudnn-frontend. ``backend``
(``CudnnBackend``: build, load and save through the plan store), ``plan`` (``CudnnPlan``),
``platform`` (GPU and versions, handles, streams), ``capabilities`` (what cuDNN runs where),
``lowering`` (problem -> frontend graph), ``workarounds`` (known cuDNN bugs), ``autotune`` (timing
candidates, and the ``set_autotune`` default) and ``frontend_internals`` (every private frontend
call). Importing this folder imports no frontend: each module imports ``cudnn`` where it calls it.
Nothing is re-exported here: import the module.
"""
