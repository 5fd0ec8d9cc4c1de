"""``cudnn_attn.bench``: what ``cudnn-attn bench`` measures, shipped so anyone can check the
figures of ``docs/benchmarks.md`` on their own GPU. ``attention`` (the attention table, FMHA_v2
lines, cold start), ``host`` (host time per call, and ``round_order``, the shuffled rounds
every table uses), ``targets`` (decoder-stack step, paged-decode bandwidth, fused vs naive),
``fp8``, ``varlen``, ``serving`` and ``prefill`` (paged decode and chunked prefill), and
``context_parallel`` (ring scaling; also ``python -m cudnn_attn.bench.context_parallel``); around
them ``charts`` and ``chart_kit`` (``--plot``: a chart per section, spreads as error bars),
``reports`` (``--json`` out and back) and ``progress`` (tqdm bars on a terminal only).
The library never imports this folder; only ``cli/`` does, one module per section, when that
section runs. Bench imports public names as a user would, plus the seams it measures: the
frontend-direct column (``CudnnPlan.variant_pack``, ``cudnn_handle``), ``ops.cudnn.autotune``,
``shapes.Shape``, ``core.synthetic``, ``fp8.quantised``, and for the compute-only column
(a ring with its transfers left out, defined here) ``distributed.context_parallel``'s ``attend``
and ``Setup`` with ``exchange.Ring`` and ``checks.checked``. Nothing is re-exported here: import the module a section lives in.
"""
