"""The frontend's run-time rows on cuDNN, each written once and run through ``cudnn_attn`` and the
real frontend on the same inputs: THD graphs run with ``execute(override_*)`` and with packed
[T, H, D] tensors bound to 4-D graph tensors (test_sdpa_thd.py's and test_sdpa_with_caching.py's
forms), candidate plans run by index, a pass-by-value ``attn_scale`` tensor read at each run,
``jit``/``graph_cache``/``graph``. Results against the float64 oracle; outputs start as NaN."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu

H, D = 4, 64
TOL = TOLERANCE[torch.float16]


def _modules():
    import cudnn

    return {"cudnn_attn": cudnn_attn, "frontend": cudnn}


def _oracle(q, k, v, scale, causal, lengths_q=None, lengths_kv=None):
    """Per sequence: q [T, H, D] packed (with lengths_q) or [B, H, S, D]; k, v [B, H, S, D]."""
    outs, start = [], 0
    for i in range(k.shape[0]):
        n_q = lengths_q[i] if lengths_q is not None else q.shape[2]
        n_kv = lengths_kv[i] if lengths_kv is not None else k.shape[2]
        qi = q[start : start + n_q].transpose(0, 1)[None] if lengths_q is not None else q[i : i + 1]
        start += n_q
        mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril() if causal else None
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qi.double(),
                k[i : i + 1, :, :n_kv].double(),
                v[i : i + 1, :, :n_kv].double(),
                attn_mask=mask,
                scale=scale,
            )
        )
    return outs


def _thd_graph(mod, b, max_s_q, s_kv, **kwargs):
    handle = mod.create_handle()
    g = mod.pygraph(
        io_data_type=mod.data_type.HALF,
        intermediate_data_type=mod.data_type.FLOAT,
        compute_data_type=mod.data_type.FLOAT,
        handle=handle,
        **kwargs,
    )
    q = g.tensor(name="Q", dim=(b, H, max_s_q, D), stride=(H * D, D, H * D, 1), data_type=mod.data_type.HALF, uid=1)
    q.set_ragged_offset(
        g.tensor(name="q_off", dim=(b + 1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=mod.data_type.INT64, uid=50)
    )
    bshd = (s_kv * H * D, D, H * D, 1)
    k = g.tensor(name="K", dim=(b, H, s_kv, D), stride=bshd, data_type=mod.data_type.HALF, uid=2)
    v = g.tensor(name="V", dim=(b, H, s_kv, D), stride=bshd, data_type=mod.data_type.HALF, uid=3)
    lengths = [
        g.tensor(name=n, dim=(b, 1, 1, 1), stride=(1, 1, 1, 1), data_type=mod.data_type.INT32, uid=u)
        for n, u in (("seq_q", 100), ("seq_kv", 101))
    ]
    o, _ = g.sdpa(
        name="sdpa_thd",
        q=q,
        k=k,
        v=v,
        attn_scale=D**-0.5,
        use_padding_mask=True,
        seq_len_q=lengths[0],
        seq_len_kv=lengths[1],
        use_causal_mask=True,
        generate_stats=False,
    )
    o.set_output(True).set_dim((b, H, max_s_q, D)).set_stride((H * D, D, H * D, 1)).set_data_type(mod.data_type.HALF)
    o.set_uid(1000)
    o.set_ragged_offset(
        g.tensor(name="o_off", dim=(b + 1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=mod.data_type.INT64, uid=51)
    )
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([mod.heur_mode.A, mod.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, handle


def _thd_inputs(lengths_q, lengths_kv, s_kv, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b = len(lengths_q)
    q = torch.randn(sum(lengths_q), H, D, device="cuda", generator=gen).half()
    k, v = (torch.randn(b, s_kv, H, D, device="cuda", generator=gen).half().transpose(1, 2) for _ in range(2))
    starts = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    offsets = (starts * H * D).view(-1, 1, 1, 1)
    seq_q = torch.tensor(lengths_q, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)
    seq_kv = torch.tensor(lengths_kv, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)
    return q, k, v, offsets, seq_q, seq_kv


def _check_thd(out, q, k, v, lengths_q, lengths_kv):
    start = 0
    for i, want in enumerate(_oracle(q, k, v, D**-0.5, True, lengths_q, lengths_kv)):
        got = out[start : start + lengths_q[i]].transpose(0, 1)[None]
        assert rel_err(got, want) < TOL, i
        start += lengths_q[i]
    assert not out.isnan().any()


def test_thd_graph_with_per_run_overrides_matches_the_oracle_and_the_frontend():
    """cudnn_attn plans each override as its own problem, so it runs on any cuDNN; the frontend
    hands the overrides to cuDNN, which takes them from 9.21 on (compared where it runs)."""
    b, s_kv, built = 3, 128, 64
    results = {}
    for label, mod in _modules().items():
        try:
            g, handle = _thd_graph(mod, b, built, s_kv, is_override_shape_enabled=True)
        except mod.cudnnGraphNotSupportedError as error:  # the frontend: override shapes need cuDNN >= 9.21
            assert label == "frontend" and "9.21" in str(error), error
            continue
        for run, lengths_q in enumerate(([17, 64, 5], [100, 3, 77])):  # the second is longer than built
            lengths_kv = [128, 40, 90]
            q, k, v, offsets, seq_q, seq_kv = _thd_inputs(lengths_q, lengths_kv, s_kv, seed=run)
            out = torch.full_like(q, float("nan"))
            pack = {1: q, 50: offsets, 2: k, 3: v, 100: seq_q, 101: seq_kv, 1000: out, 51: offsets}
            uids = list(pack)
            shapes = [[b, H, max(lengths_q), D] if u in (1, 1000) else list(pack[u].shape) for u in uids]
            strides = [list(pack[u].stride()) for u in uids]
            workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")
            mod.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
            g.execute(
                pack, workspace, handle=handle, override_uids=uids, override_shapes=shapes, override_strides=strides
            )
            torch.cuda.synchronize()
            _check_thd(out, q, k, v, lengths_q, lengths_kv)
            results[label, run] = out
    for run in range(2):
        if ("frontend", run) in results:
            assert rel_err(results["cudnn_attn", run], results["frontend", run]) < TOL


def test_packed_tensors_bound_to_a_graph_built_for_the_longest_sequence():
    b, s_kv = 2, 256
    lengths_q, lengths_kv = [37, 200], [256, 11]
    results = {}
    for label, mod in _modules().items():
        g, handle = _thd_graph(mod, b, 256, s_kv)
        q, k, v, offsets, seq_q, seq_kv = _thd_inputs(lengths_q, lengths_kv, s_kv, seed=5)
        out = torch.full_like(q, float("nan"))
        workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")
        g.execute(
            {1: q, 50: offsets, 2: k, 3: v, 100: seq_q, 101: seq_kv, 1000: out, 51: offsets}, workspace, handle=handle
        )
        torch.cuda.synchronize()
        _check_thd(out, q, k, v, lengths_q, lengths_kv)
        results[label] = out
    assert rel_err(results["cudnn_attn"], results["frontend"]) < TOL


def test_each_candidate_plan_runs_by_index():
    b, s = 2, 256
    gen = torch.Generator(device="cuda").manual_seed(3)
    data = [torch.randn(b, H, s, D, device="cuda", generator=gen).half() for _ in range(3)]
    want = _oracle(*data, D**-0.5, True)
    g = cudnn_attn.pygraph(io_data_type=cudnn_attn.data_type.HALF)
    q, k, v = (g.tensor_like(t) for t in data)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=D**-0.5, use_causal_mask=True, generate_stats=False)
    o.set_output(True)
    g.build([cudnn_attn.heur_mode.A, cudnn_attn.heur_mode.FALLBACK])
    count = g.get_execution_plan_count()
    assert count >= 1
    ran = 0
    for index in range(min(count, 4)):
        out = torch.full_like(data[0], float("nan"))
        try:  # a candidate not built yet is built on first use, as its name is asked for
            name = g.get_plan_name_at_index(index)
            size = g.get_workspace_size_plan_at_index(index)
            workspace = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
            g.execute_plan_at_index({q: data[0], k: data[1], v: data[2], o: out}, workspace, index)
        except cudnn_attn.cudnnGraphNotSupportedError:
            continue  # a ranked candidate cuDNN cannot build here, as the frontend reports it
        assert isinstance(name, str) and name, index
        ran += 1
        torch.cuda.synchronize()
        assert all(rel_err(out[i : i + 1], want[i]) < TOL for i in range(b)), (index, name)
    assert ran >= 1  # the chosen plan at least


@pytest.mark.parametrize("on_host", [True, False], ids=["pass-by-value", "device"])
def test_a_tensor_attn_scale_is_read_at_each_run(on_host):
    b, s = 2, 128
    gen = torch.Generator(device="cuda").manual_seed(9)
    data = [torch.randn(b, H, s, D, device="cuda", generator=gen).half() for _ in range(3)]
    results = {}
    for label, mod in _modules().items():
        if label == "frontend" and not on_host:
            continue
        g = mod.pygraph(
            io_data_type=mod.data_type.HALF,
            intermediate_data_type=mod.data_type.FLOAT,
            compute_data_type=mod.data_type.FLOAT,
        )
        q, k, v = (g.tensor(dim=t.shape, stride=t.stride(), data_type=mod.data_type.HALF) for t in data)
        scale = g.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=mod.data_type.FLOAT, is_pass_by_value=on_host)
        o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=scale, use_causal_mask=True, generate_stats=False)
        o.set_output(True).set_data_type(mod.data_type.HALF)
        g.build([mod.heur_mode.A, mod.heur_mode.FALLBACK])
        workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        for value in (0.5, 0.03):
            out = torch.full_like(data[0], float("nan"))
            scale_t = torch.full((1, 1, 1, 1), value, dtype=torch.float32, device="cpu" if on_host else "cuda")
            g.execute({q: data[0], k: data[1], v: data[2], scale: scale_t, o: out}, workspace)
            torch.cuda.synchronize()
            want = _oracle(*data, value, True)
            assert all(rel_err(out[i : i + 1], want[i]) < TOL for i in range(b)), (label, value)
            results[label, value] = out
    if on_host:
        for value in (0.5, 0.03):
            assert rel_err(results["cudnn_attn", value], results["frontend", value]) < TOL


def test_jit_graph_cache_and_graph_build_once_per_key():
    made = []

    def key_fn(handle, b):
        return b

    @cudnn_attn.jit(heur_modes=[cudnn_attn.heur_mode.A, cudnn_attn.heur_mode.FALLBACK])
    @cudnn_attn.graph_cache(key_fn=key_fn)
    def lookup(handle, b):
        made.append(b)
        with cudnn_attn.graph(handle) as (g, _):
            q, k, v = (
                g.tensor(name=n, dim=(b, H, 64, D), stride=(H * 64 * D, 64 * D, D, 1), uid=i)
                for i, n in enumerate("qkv", 1)
            )
            o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=0.1, use_causal_mask=True, generate_stats=False)
            o.set_output(True).set_uid(9)
            return g, [q, k, v, o]

    handle = cudnn_attn.create_handle()
    g, uids = lookup(handle, 2)
    assert lookup(handle, 2)[0] is g and made == [2] and uids == [1, 2, 3, 9]
    gen = torch.Generator(device="cuda").manual_seed(4)
    data = [torch.randn(2, H, 64, D, device="cuda", generator=gen).half() for _ in range(3)]
    out = torch.full_like(data[0], float("nan"))
    g.execute({1: data[0], 2: data[1], 3: data[2], 9: out}, None, handle=handle)
    torch.cuda.synchronize()
    want = _oracle(*data, 0.1, True)
    assert all(rel_err(out[i : i + 1], want[i]) < TOL for i in range(2))


def test_a_serialized_cudnn_graph_runs_again_without_planning():
    b, s = 2, 128
    gen = torch.Generator(device="cuda").manual_seed(12)
    data = [torch.randn(b, H, s, D, device="cuda", generator=gen).half() for _ in range(3)]
    g = cudnn_attn.pygraph(io_data_type=cudnn_attn.data_type.HALF)
    q, k, v = (g.tensor_like(t).set_uid(i) for i, t in enumerate(data, 1))
    o, stats = g.sdpa(q=q, k=k, v=v, attn_scale=0.2, use_causal_mask=True, generate_stats=True)
    o.set_output(True).set_uid(4)
    stats.set_output(True).set_uid(5)
    g.build()
    blob = g.serialize(as_bytes=True)
    restored = cudnn_attn.pygraph()
    restored.deserialize(cudnn_attn.create_handle(), blob)
    assert restored.problems == g.problems and restored.nodes[0].plan.source == "disk"
    results = []
    for graph in (g, restored):
        out = torch.full_like(data[0], float("nan"))
        lse = torch.full((b, H, s, 1), float("nan"), device="cuda")
        graph.execute({1: data[0], 2: data[1], 3: data[2], 4: out, 5: lse})
        results.append((out, lse))
    torch.cuda.synchronize()
    want = _oracle(*data, 0.2, True)
    assert all(rel_err(results[1][0][i : i + 1], want[i]) < TOL for i in range(b))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    # Its plan helpers address the one plan it holds (cuDNN's deserialised graph names none by index).
    assert restored.get_execution_plan_count() == 1
    assert restored.get_plan_name_at_index(0) == restored.nodes[0].plan.engine
    workspace = torch.empty(max(restored.get_workspace_size_plan_at_index(0), 1), dtype=torch.uint8, device="cuda")
    out = torch.full_like(data[0], float("nan"))
    lse = torch.full((b, H, s, 1), float("nan"), device="cuda")
    restored.execute_plan_at_index({1: data[0], 2: data[1], 3: data[2], 4: out, 5: lse}, workspace, 0)
    torch.cuda.synchronize()
    assert torch.equal(out, results[1][0]) and torch.equal(lse, results[1][1])
