"""A CPU install has no cuDNN frontend (it comes with the GPU extras): everything on CPU
tensors still runs, frontend-style code included, and the frontend's own queries say what to
install. Run in a fresh interpreter where ``import cudnn`` fails, as it does without the package."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["cudnn"] = None  # as if nvidia-cudnn-frontend were not installed
    import torch
    import cudnn_attn as cudnn

    q, k, v = (torch.randn(2, 4, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    out = cudnn.sdpa(q, k, v, is_causal=True)
    with cudnn.Graph() as g:
        o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    graph_out = g(q, k, v)
    g2 = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16)  # the frontend's low-level spelling
    for result in (out, graph_out):
        assert (result.float() - expected).abs().max() < 2e-2
    try:
        cudnn.backend_version()
    except cudnn.UnsupportedError as error:
        assert "nvidia-cudnn-frontend" in str(error), error
    else:
        raise AssertionError("backend_version() answered without a frontend")
    assert "cudnn" not in {m for m in sys.modules if sys.modules[m] is not None}
    print("ok")
    """
)


def test_cpu_tensors_run_without_the_frontend():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
