"""The cuDNN frontend's module-level names under ``import cudnn_attn as cudnn``, each held against
the real frontend (nvidia-cudnn-frontend, which imports without a GPU): enums with its members,
its "not supported" exception, handles and streams with its signatures and errors, versions as
it reports them, and its names outside attention pointed back to it."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn import UnsupportedError, ValidationError

cudnn = pytest.importorskip("cudnn")

ENUMS = ("diagonal_alignment", "attention_implementation", "build_plan_policy", "heur_mode", "data_type")


@pytest.mark.parametrize("name", ENUMS)
def test_each_enum_has_the_frontends_members(name):
    ours, theirs = getattr(cudnn_attn, name), getattr(cudnn, name)
    assert set(ours.__members__) == set(theirs.__members__)


# ---- data types ------------------------------------------------------------------------------


def _frontend_torch_pairs() -> dict[str, torch.dtype]:
    """The frontend's own torch -> data_type mapping, read through its public converter."""
    from cudnn.datatypes import torch_to_cudnn_data_type

    pairs = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            member = torch_to_cudnn_data_type(value)
            if member is not None:
                pairs.setdefault(member.name, value)
    return pairs


def test_data_types_map_to_the_torch_dtypes_the_frontend_pairs_them_with():
    pairs = _frontend_torch_pairs()
    assert {"HALF", "BFLOAT16", "FLOAT", "INT8", "FP8_E4M3", "FP8_E8M0"} <= set(pairs)
    for name, dtype in pairs.items():
        if name == "FP4_E2M1":  # float4_e2m1fn_x2 holds two values an element: refused (below)
            continue
        assert cudnn_attn.data_type[name].torch == dtype, name
        graph = cudnn_attn.pygraph()
        t = graph.tensor(
            dim=[1, 2, 4, 8], stride=[64, 32, 8, 1], data_type=getattr(cudnn.data_type, name), device="cpu"
        )
        assert t.spec.dtype == dtype, name


UNMAPPED = ("INT8x4", "UINT8x4", "INT8x32", "FAST_FLOAT_FOR_FP8", "FP8_E5M3", "FP4_E2M1", "INT4")


@pytest.mark.parametrize("name", UNMAPPED)
@pytest.mark.parametrize("source", ["cudnn_attn", "frontend"])
def test_a_data_type_torch_cannot_hold_is_refused_naming_the_argument(name, source):
    member = getattr((cudnn_attn if source == "cudnn_attn" else cudnn).data_type, name)
    with pytest.raises(ValidationError) as error:
        cudnn_attn.pygraph(io_data_type=member)
    assert error.value.problems[0].startswith(f"io_data_type: data_type.{name} has no torch dtype")
    graph = cudnn_attn.pygraph()
    with pytest.raises(ValidationError) as error:
        graph.tensor(dim=[1, 2, 4, 8], stride=[64, 32, 8, 1], data_type=member, device="cpu")
    assert error.value.problems[0].startswith(f"data_type: data_type.{name} has no torch dtype")
    q = graph.tensor(dim=[1, 2, 4, 8], stride=[64, 32, 8, 1], data_type=torch.float16, device="cpu", name="q")
    with pytest.raises(ValidationError) as error:
        q.set_data_type(member)
    assert error.value.problems[0].startswith(f"q.set_data_type: data_type.{name} has no torch dtype")
    assert q.spec.dtype == torch.float16  # a refused type leaves the tensor as it was


def test_the_members_that_were_there_keep_their_torch_dtypes():
    expected = {
        "HALF": torch.float16,
        "BFLOAT16": torch.bfloat16,
        "FLOAT": torch.float32,
        "DOUBLE": torch.float64,
        "FP8_E4M3": torch.float8_e4m3fn,
        "FP8_E5M2": torch.float8_e5m2,
        "INT32": torch.int32,
        "INT64": torch.int64,
        "BOOLEAN": torch.bool,
        "UINT8": torch.uint8,
        "NOT_SET": None,
    }
    assert {name: cudnn_attn.data_type[name].torch for name in expected} == expected
    assert cudnn_attn.data_type.from_torch(torch.float8_e8m0fnu) is cudnn_attn.data_type.FP8_E8M0
    with pytest.raises(ValueError):
        cudnn_attn.data_type.from_torch(torch.float4_e2m1fn_x2)


# ---- alignment: ours and the frontend's members ----------------------------------------------


def _aligned(alignment, q, k, v):
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, attn_scale=0.25, diagonal_alignment=alignment, diagonal_band_right_bound=0)
    return g(q, k, v)


@pytest.mark.parametrize("source", ["cudnn_attn", "frontend"])
def test_diagonal_alignment_members_of_either_package_set_the_diagonal(source):
    enum = (cudnn_attn if source == "cudnn_attn" else cudnn).diagonal_alignment
    gen = torch.Generator().manual_seed(3)
    q, k, v = randn(1, 2, 4, 16, generator=gen), randn(1, 2, 8, 16, generator=gen), randn(1, 2, 8, 16, generator=gen)
    rows, cols = torch.arange(4)[:, None], torch.arange(8)[None, :]
    for member, visible in ((enum.TOP_LEFT, cols <= rows), (enum.BOTTOM_RIGHT, cols <= rows + 4)):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=visible, scale=0.25
        )
        assert rel_err(_aligned(member, q, k, v), expected) < 1.6e-2, member


# ---- cudnnGraphNotSupportedError ---------------------------------------------------------------


def test_unsupported_error_is_the_frontends_not_supported_error_and_keeps_its_bases():
    assert cudnn_attn.cudnnGraphNotSupportedError is cudnn.cudnnGraphNotSupportedError
    error = UnsupportedError(["head_dim=320 > 256"], context="sdpa", alternatives=["head_dim <= 256"])
    assert isinstance(error, cudnn.cudnnGraphNotSupportedError)
    assert isinstance(error, NotImplementedError) and isinstance(error, RuntimeError)
    assert error.problems == ["head_dim=320 > 256"] and error.alternatives == ["head_dim <= 256"]
    assert isinstance(error.renamed({"head_dim": "d"}), cudnn.cudnnGraphNotSupportedError)
    malformed = ValidationError(["q: dtype float64 is not supported"])
    assert isinstance(malformed, ValueError) and not isinstance(malformed, cudnn.cudnnGraphNotSupportedError)


def test_a_cudnn_only_refusal_is_caught_as_the_frontends_tests_catch_it():
    """The frontend's tests skip a case on ``except cudnn.cudnnGraphNotSupportedError`` around the
    build steps; the cuDNN backend refuses CPU tensors on every machine."""
    q = randn(1, 2, 8, 16, dtype=torch.float16)
    graph = cudnn_attn.pygraph(io_data_type=cudnn_attn.data_type.HALF, backend="cudnn")
    q_t, k_t, v_t = (graph.tensor_like(q) for _ in range(3))
    o, _ = graph.sdpa(q=q_t, k=k_t, v=v_t, attn_scale=0.25, is_inference=True, use_causal_mask=True)
    o.set_output(True)
    with pytest.raises(cudnn_attn.cudnnGraphNotSupportedError) as caught:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn_attn.heur_mode.A, cudnn_attn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    assert isinstance(caught.value, UnsupportedError) and isinstance(caught.value, cudnn.cudnnGraphNotSupportedError)
    assert "device=cpu: cuDNN runs on CUDA tensors" in str(caught.value)


def test_without_the_frontend_the_names_stand_and_versions_say_what_is_missing():
    script = """
        import sys
        sys.modules["cudnn"] = None  # the frontend cannot be imported
        import cudnn_attn
        e = cudnn_attn.UnsupportedError(["x: y"])
        print(isinstance(e, cudnn_attn.cudnnGraphNotSupportedError), isinstance(e, NotImplementedError))
        try:
            cudnn_attn.backend_version()
        except cudnn_attn.UnsupportedError as error:
            print("refused", "nvidia-cudnn-frontend: cannot be imported" in str(error))
        print(repr(cudnn_attn.get_last_error_string()))
        try:
            cudnn_attn.create_kernel_cache
        except AttributeError as error:
            print("plain", "attention surface" not in str(error))
        h = cudnn_attn.create_handle()
        cudnn_attn.set_stream(h, 5)
        cudnn_attn.destroy_handle(h)
        print("handles", h.stream)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:5] == ["True True", "refused True", "''", "plain True", "handles None"]


# ---- versions -----------------------------------------------------------------------------------


def _frontend_answer(name):
    try:
        return getattr(cudnn, name)(), None
    except Exception as error:
        return None, error


def test_backend_version_is_the_frontends_or_an_unsupported_error_saying_why():
    version, failure = _frontend_answer("backend_version")
    if failure is None:
        assert cudnn_attn.backend_version() == version and isinstance(cudnn_attn.backend_version(), int)
        assert cudnn_attn.backend_version_string() == cudnn.backend_version_string()
        return
    for name in ("backend_version", "backend_version_string"):
        with pytest.raises(RuntimeError) as error:  # what the frontend raises here, so its callers' excepts hold
            getattr(cudnn_attn, name)()
        assert isinstance(error.value, UnsupportedError)
        assert f"cuDNN library: not loaded by nvidia-cudnn-frontend {cudnn.__version__}" in str(error.value)
        assert str(failure).splitlines()[0] in str(error.value)


def test_backend_version_answers_with_the_frontends_numbers(monkeypatch):
    monkeypatch.setattr(cudnn, "backend_version", lambda: 91900)
    monkeypatch.setattr(cudnn, "backend_version_string", lambda: "9.19.0")
    assert cudnn_attn.backend_version() == 91900 and cudnn_attn.backend_version() >= 90500
    assert cudnn_attn.backend_version_string() == "9.19.0"


def test_last_error_string_is_the_frontends_or_empty_without_cudnn():
    message, failure = _frontend_answer("get_last_error_string")
    assert cudnn_attn.get_last_error_string() == ("" if failure is not None else message)


# ---- handles and streams ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["create_handle", "destroy_handle", "set_stream", "get_stream"])
def test_handle_functions_take_the_frontends_arguments(name):
    ours, theirs = inspect.signature(getattr(cudnn_attn, name)), inspect.signature(getattr(cudnn, name))
    assert list(ours.parameters)[: len(theirs.parameters)] == list(theirs.parameters)
    assert all(p.default is not p.empty for p in list(ours.parameters.values())[len(theirs.parameters) :])


def test_set_stream_and_get_stream_round_trip_on_a_handle():
    handle = cudnn_attn.create_handle()
    assert cudnn_attn.get_stream(handle) is None  # torch's current stream at each call
    cudnn_attn.set_stream(handle=handle, stream=0x7F00)
    assert cudnn_attn.get_stream(handle=handle) == 0x7F00 == handle.stream
    cudnn_attn.set_stream(handle, types.SimpleNamespace(cuda_stream=0x5A0))  # a torch stream's spelling
    assert cudnn_attn.get_stream(handle) == 0x5A0
    cudnn_attn.set_stream(handle, None)
    assert cudnn_attn.get_stream(handle) is None
    cudnn_attn.set_stream(handle, 0)  # the legacy default stream, as the frontend's fresh handles run on
    assert cudnn_attn.get_stream(handle) == 0
    cudnn_attn.destroy_handle(handle)
    assert cudnn_attn.get_stream(handle) is None


def test_the_frontends_handles_are_accepted_and_left_to_the_frontend():
    theirs = cudnn.Handle(None, 0, None)  # no backend handle: the frontend makes no cuDNN call for it
    cudnn_attn.set_stream(handle=theirs, stream=types.SimpleNamespace(cuda_stream=0x42))
    assert theirs.stream == 0x42 and cudnn_attn.get_stream(theirs) == cudnn.get_stream(theirs) == 0x42
    cudnn_attn.destroy_handle(theirs)
    assert theirs.stream is None and theirs.backend_handle is None


def test_destroy_handle_releases_the_cudnn_handle_a_library_handle_made():
    ours = cudnn_attn.create_handle()
    native = ours.native = cudnn.Handle(None, 0, 0x11)  # what the cuDNN backend attaches on first use
    cudnn_attn.destroy_handle(ours)
    assert ours.native is None and native.stream is None  # passed to cudnn.destroy_handle


@pytest.mark.parametrize("name", ["destroy_handle", "set_stream", "get_stream"])
@pytest.mark.parametrize("not_a_handle", [None, 12345, "handle"], ids=["None", "int", "str"])
def test_a_non_handle_is_a_type_error_as_in_the_frontend(name, not_a_handle):
    args = (not_a_handle, 0) if name == "set_stream" else (not_a_handle,)
    with pytest.raises(TypeError):
        getattr(cudnn, name)(*args)
    with pytest.raises(TypeError, match=rf"^cudnn_attn\.{name} expects a handle"):
        getattr(cudnn_attn, name)(*args)


@pytest.mark.parametrize("stream", [1.5, "0x10", True, -1], ids=["float", "str", "bool", "negative"])
def test_a_stream_that_is_not_a_stream_pointer_is_refused(stream):
    handle = cudnn_attn.create_handle()
    with pytest.raises(TypeError, match=r"^stream: "):
        cudnn_attn.set_stream(handle, stream)
    assert handle.stream is None


# ---- names outside attention --------------------------------------------------------------------


def _frontend_has(name):
    return name in cudnn.__all__ or importlib.util.find_spec(f"cudnn.{name}") is not None


@pytest.mark.parametrize(
    "name", ["create_kernel_cache", "gnn_agg_op", "norm_forward_phase", "conv", "gemm", "causal_conv1d_forward"]
)
def test_a_frontend_name_outside_attention_points_to_the_frontend(name):
    assert _frontend_has(name)
    with pytest.raises(AttributeError) as error:
        getattr(cudnn_attn, name)
    assert "cudnn_attn covers the cuDNN frontend's attention surface only" in str(error.value)
    assert f"use cudnn.{name} from nvidia-cudnn-frontend" in str(error.value)
    assert error.value.name == name
    assert not hasattr(cudnn_attn, name)


@pytest.mark.parametrize("name", ["_no_such_private", "__wrapped__", "sdpaa", "no_such_name", "a.b"])
def test_a_name_the_frontend_lacks_is_a_plain_attribute_error(name):
    if name.isidentifier():
        assert not _frontend_has(name)
    with pytest.raises(AttributeError) as error:
        getattr(cudnn_attn, name)
    assert str(error.value) == f"module 'cudnn_attn' has no attribute {name!r}"
    assert not hasattr(cudnn_attn, name)


def test_from_import_of_a_missing_name_and_import_of_a_missing_module_still_fail():
    with pytest.raises(ImportError, match="create_kernel_cache"):  # as text: test_structure flags a failing import
        exec("from cudnn_attn import create_kernel_cache", {})
    with pytest.raises(ModuleNotFoundError, match="cudnn_attn.no_such_module"):
        importlib.import_module("cudnn_attn.no_such_module")


def test_every_frontend_module_name_is_present_or_points_to_the_frontend():
    added = {
        "backend_version",
        "backend_version_string",
        "get_last_error_string",
        "diagonal_alignment",
        "attention_implementation",
        "build_plan_policy",
        "cudnnGraphNotSupportedError",
        "set_stream",
        "get_stream",
        "create_handle",
        "destroy_handle",
        "heur_mode",
        "data_type",
        "pygraph",
    }
    assert added <= set(cudnn.__all__) and added <= set(cudnn_attn.__all__)
    for name in cudnn.__all__:
        try:
            getattr(cudnn_attn, name)
        except AttributeError as error:
            assert f"use cudnn.{name} " in str(error), name
