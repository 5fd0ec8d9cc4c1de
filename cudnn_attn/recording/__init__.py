"""``cudnn_attn.recording``: what ``Graph`` records and how a recording becomes a build (Graph's
machinery; ``graph.py`` holds only its public methods). ``handles`` (the tensor handles ops take
and return), ``node`` (one recorded op), ``ops_table`` (each op declared once: its parameters,
roles and outputs), ``keywords`` (the mask keywords, parsed once), ``state``
(a graph's recording: nodes, inputs, names, calls), ``interpret`` (each op's recorded call,
interpreted at build), ``score_mod`` (score_mod callbacks traced), ``assembly`` (node ->
``AttentionProblem``), ``pairing`` (a backward fed its forward's outputs), ``build`` (adopt an
earlier build, or validate every node and plan it through the runtime), ``key`` and ``reuse`` (a
recording that repeats an earlier one adopts its build). Nothing is re-exported here;
``recording`` imports neither ``graph.py`` nor the frontend's dialect (``frontend/``), and its
modules import each other one way (handles and the key name what they need of a recording as
Protocols).
"""
