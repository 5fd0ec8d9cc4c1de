"""``cudnn_attn.runtime``: problems to running plans. ``planner`` (a problem's plan through the plan
cache: backend chosen, built on a miss, logged), ``prepared`` (``prepare(problem)``: the one door
below ``Graph`` every entry point takes, a validated problem's plan ready to run on tensors by
role), ``runner`` (a built graph's run: bind, check, run its plans), ``interop`` (DLPack in and
out), ``lifecycle`` (native plans released at exit). Nothing is re-exported here.
"""
