"""Start-up: ``import cudnn_attn`` loads none of the heavy modules until a name needs them, and the
names still resolve, the frontend's exception included, in a fresh interpreter each."""

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("cudnn", "triton", "transformers", "torch._dynamo", "torch.nn.attention.bias")


def _run(script: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_import_loads_no_heavy_module_and_only_the_package_root():
    loaded = _run(f"""
        import sys, torch
        before = set(sys.modules)
        import cudnn_attn
        new = set(sys.modules) - before
        print(*[m for m in {HEAVY!r} if m in new] or ["none"])
        print(len([m for m in new if m.startswith("cudnn_attn.")]))
    """)
    assert loaded[0] == "none", f"import cudnn_attn loaded {loaded[:-1]}"
    assert int(loaded[-1]) <= 3, f"{loaded[-1]} submodules at import"


def test_every_public_name_resolves_and_the_sdpa_path_needs_no_frontend_on_cpu():
    out = _run("""
        import sys, torch, cudnn_attn
        q = torch.randn(1, 2, 8, 16)
        cudnn_attn.sdpa(q, q, q)
        print("frontend", "cudnn" in sys.modules, "dynamo", "torch._dynamo" in sys.modules)
        missing = [n for n in cudnn_attn.__all__ if not hasattr(cudnn_attn, n)]
        print("missing:", *missing or ["none"])
        print("graph", callable(cudnn_attn.graph), "Graph" in dir(cudnn_attn))
    """)
    assert out[:4] == ["frontend", "False", "dynamo", "False"], out
    assert out[4:] == ["missing:", "none", "graph", "True", "True"], out


@pytest.mark.parametrize("order", ["frontend imported after the error class", "frontend asked for by name"])
def test_the_frontends_except_clause_catches_unsupported_errors_imported_lazily(order):
    pytest.importorskip("cudnn")
    out = _run(f"""
        import cudnn_attn
        error = cudnn_attn.UnsupportedError(["x: not here"])  # made before the frontend is imported
        if {order!r} == "frontend asked for by name":
            frontend = cudnn_attn.cudnnGraphNotSupportedError
            import cudnn
            assert frontend is cudnn.cudnnGraphNotSupportedError
        import cudnn
        try:
            raise cudnn_attn.UnsupportedError(["x: not here"])
        except cudnn.cudnnGraphNotSupportedError as caught:
            print("caught", isinstance(caught, NotImplementedError), isinstance(error, cudnn.cudnnGraphNotSupportedError))
    """)
    assert out == ["caught", "True", "True"]


def test_causal_bias_objects_are_read_once_their_module_is_imported():
    out = _run("""
        import torch, cudnn_attn
        from torch.nn.attention.bias import causal_lower_right
        q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 6, 16)
        got = cudnn_attn.sdpa(q, k, k, attn_mask=causal_lower_right(4, 6))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(4, 6))
        print(torch.allclose(got, want, atol=1e-5))
    """)
    assert out == ["True"]
