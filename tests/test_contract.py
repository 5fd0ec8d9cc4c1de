"""The public contract where it was once broken: positional order, training detection, device
names, argument names in errors, one keyword definition shared by every op."""

from __future__ import annotations

import inspect
import math

import oracle
import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.core.problem import device_name
from cudnn_attn.recording.keywords import MaskKeywords


def _paged(b=2, h=4, h_kv=2, s_kv=24, d=16, page=8, seed=0):
    """A dense K and its paged cache [pages, page, H_kv, D] with a shuffled page table."""
    gen = torch.Generator().manual_seed(seed)
    dense = randn(b, h_kv, s_kv, d, generator=gen)
    per_seq = s_kv // page
    order = torch.randperm(b * per_seq, generator=gen)
    cache = torch.empty(b * per_seq, page, h_kv, d, dtype=dense.dtype)
    for i in range(b):
        for j in range(per_seq):
            cache[order[i * per_seq + j]] = dense[i, :, j * page : (j + 1) * page].transpose(0, 1)
    table = order.view(b, per_seq).to(torch.int32)
    return dense, cache, table


def test_paged_graph_runs_in_the_order_of_its_method_parameters():
    """g.sdpa_with_paged_cache(q, k, v, page_table, seq_len_kv=...) runs as g(q, k, v, page_table, seq_len_kv)."""
    q = randn(2, 4, 1, 16)
    k_dense, k_cache, table = _paged(seed=1)
    lengths = torch.tensor([24, 11], dtype=torch.int32)
    with cudnn_attn.Graph() as g:
        g.sdpa_with_paged_cache(q, k_cache, k_cache, table, seq_len_kv=lengths)
    assert [h.name for h in g.inputs] == ["q", "k", "page_table", "seq_len_kv"]
    out = g(q, k_cache, table, lengths)  # the cache serves as k and v: one input
    expected, _ = oracle.attention(q, k_dense, k_dense, scale=16**-0.5, seq_kv=[24, 11])
    assert rel_err(out, expected) < 1e-2


def test_paged_graph_takes_sdpas_sink_token_and_tensor_scale():
    """The paged node takes the scale and sink keywords of sdpa (a graph-tensor attn_scale and
    sink_token were left out of its inputs: a KeyError at build)."""
    q = randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(3))
    k_dense, k_cache, table = _paged(seed=4)
    lengths = torch.tensor([24, 11], dtype=torch.int32)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).view(1, 4, 1, 1)
    with cudnn_attn.Graph() as g:
        scale = g.tensor(name="scale", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=torch.float32)
        g.sdpa_with_paged_cache(q, k_cache, k_cache, table, seq_len_kv=lengths, attn_scale=scale, sink_token=sinks)
    out = g(q, k_cache, table, lengths, torch.full((1, 1, 1, 1), 0.3), sinks)
    k64 = k_dense.double().repeat_interleave(2, dim=1)
    scores = q.double() @ k64.transpose(-1, -2) * 0.3
    scores[1, :, :, 11:] = -math.inf
    logits = torch.cat([scores, sinks.double().expand(2, 4, 1, 1)], dim=-1)
    expected = torch.softmax(logits, dim=-1)[..., :-1] @ k64
    assert rel_err(out, expected) < 1e-2


def test_positional_order_is_each_methods_parameter_order_whatever_the_keyword_order():
    q, k, v = (randn(2, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    bias = randn(1, 2, 8, 8)
    lengths_q, lengths_kv = torch.tensor([8, 5], dtype=torch.int32), torch.tensor([7, 8], dtype=torch.int32)
    with cudnn_attn.Graph() as g:  # keywords given in reverse order
        g.sdpa(q, k, v, seq_len_kv=lengths_kv, seq_len_q=lengths_q, use_padding_mask=True, attn_bias=bias)
    assert [h.name for h in g.inputs] == ["q", "k", "v", "attn_bias", "seq_len_q", "seq_len_kv"]


def test_a_learned_mask_with_frozen_qkv_trains():
    """Training is decided from every differentiable input, the mask included."""
    q, k, v = (randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.randn(1, 2, 8, 8, dtype=torch.bfloat16).requires_grad_()
    out = cudnn_attn.sdpa(q, k, v, attn_mask=mask)
    out.float().sum().backward()
    mask64 = mask.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask64)
    ref.sum().backward()
    assert mask.grad is not None and rel_err(mask.grad, mask64.grad) < 3e-2


def test_device_names_are_normalised_once():
    assert device_name("cuda") == device_name(torch.device("cuda")) == device_name("cuda:0")
    assert device_name("cpu") == "cpu"
    t = cudnn_attn.Graph().tensor(dim=[1, 2, 8, 16], stride=[256, 128, 16, 1], data_type=torch.float16, device="cuda")
    assert t.spec.device == "cuda:0"


def test_graph_tensor_defaults_to_a_device_this_machine_has():
    with cudnn_attn.Graph() as g:
        t = g.tensor(dim=[1, 2, 8, 16], stride=[256, 128, 16, 1], data_type=torch.float16)
        g.sdpa(t, t, t)
    assert t.spec.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    x = torch.randn(1, 2, 8, 16, dtype=torch.float16, device=t.spec.device)
    assert g(x).shape == x.shape


@pytest.mark.skipif(torch.cuda.is_available(), reason="the hint is for machines without a GPU")
def test_the_hint_for_cuda_descriptors_without_a_gpu_works_when_followed():
    with pytest.raises(cudnn_attn.UnsupportedError) as caught:
        with cudnn_attn.Graph() as g:
            t = g.tensor(dim=[1, 2, 8, 16], stride=[256, 128, 16, 1], data_type=torch.float16, device="cuda:0")
            g.sdpa(t, t, t)
    assert "device='cpu'" in str(caught.value)
    with cudnn_attn.Graph() as g:  # following it
        t = g.tensor(dim=[1, 2, 8, 16], stride=[256, 128, 16, 1], data_type=torch.float16, device="cpu")
        g.sdpa(t, t, t)
    assert torch.isfinite(g(torch.randn(1, 2, 8, 16, dtype=torch.float16))).all()


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"scale": "0.5"}, "scale"),
        ({"dropout_p": 1.5}, "dropout_p"),
        ({"attn_mask": torch.zeros(3, 3)}, "attn_mask"),
        ({"query": torch.randn(1, 2, 8, 12, dtype=torch.bfloat16)}, "query"),
        ({"query": torch.randn(1, 2, 8, 16, dtype=torch.float64)}, "query"),
    ],
    ids=["scale", "dropout_p", "attn_mask", "head-dim-mismatch", "query-dtype"],
)
def test_sdpa_errors_name_its_own_arguments(kwargs, argument):
    args = {n: randn(1, 2, 8, 16) for n in ("query", "key", "value")}
    args.update(kwargs)
    if argument == "query" and args["query"].shape[-1] != 16:  # key's head dim differs: named by key
        argument = "key"
    with pytest.raises(cudnn_attn.ValidationError) as caught:
        cudnn_attn.sdpa(**args)
    lines = caught.value.problems
    assert any(line.startswith(f"{argument}:") for line in lines), lines
    assert not any(line.split(":")[0] in ("q", "k", "v", "attn_bias", "attn_scale", "dropout") for line in lines)


@pytest.mark.parametrize("op", ["sdpa", "sdpa_backward", "sdpa_with_paged_cache"])
def test_every_op_publishes_every_mask_keyword(op):
    params = inspect.signature(getattr(cudnn_attn.Graph, op)).parameters
    wanted = {f for f in MaskKeywords.__dataclass_fields__} - {"seq_len_q", "seq_len_kv", "max_seq_len_kv"}
    assert wanted <= set(params), wanted - set(params)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_an_unknown_keyword_is_a_validation_error_naming_it():
    q = randn(1, 2, 8, 16)
    with pytest.raises(cudnn_attn.ValidationError, match="use_casual_mask: not a keyword of sdpa"):
        with cudnn_attn.Graph() as g:
            g.sdpa(q, q, q, use_casual_mask=True)


def test_default_scale_is_one_over_sqrt_head_dim_everywhere():
    q = randn(1, 2, 8, 64)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    assert g.problems[0].options.attn_scale == pytest.approx(1 / math.sqrt(64))
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert rel_err(cudnn_attn.sdpa(q, q, q), expected) < 1e-2
