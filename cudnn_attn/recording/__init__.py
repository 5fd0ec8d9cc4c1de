"""``cudnn_attn.recording``: what ``Graph`` records and how a recording becomes a build (Graph's
machinery; ``graph.py`` holds only its public methods). ``handles`` (the tensor handles ops take
and return), ``node`` (one recorded op), ``keywords`` (the mask keywords, parsed once), ``state``
(a graph's recording: nodes, inputs, names, calls), ``assembly`` (node -> ``AttentionProblem``),
``build`` (validate every node, plan it through the runtime, order the inputs), ``key`` and
``reuse`` (a recording that repeats an earlier one adopts its build), ``fp8_ops`` and
``frontend_steps`` (the FP8 ops and the frontend's build steps, as Graph's methods). Nothing is
re-exported here; ``recording`` never imports ``graph.py``.
"""
