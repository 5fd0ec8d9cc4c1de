"""``cudnn_attn.kernels``: the Triton kernels, each with its torch fallback giving the same values
where Triton or CUDA is missing. ``fp8_cast`` (FP8 quantise, amaxes, amax history, dequantise,
for ``sdpa_fp8`` and ``Fp8Scaling``), ``lse_merge`` (merge split-KV partial outputs by their
log-sum-exp, for ``PagedAttention``) and ``paged_decode`` (single-token decode over paged caches
in one kernel, for ``PagedAttention``). They import only the package's core (``errors``), never
a backend or a door. Nothing is re-exported here (``paged_decode`` names both a module and its
function): import the module.
"""
