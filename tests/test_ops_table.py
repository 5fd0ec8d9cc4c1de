"""The op table (``recording/ops_table.py``) against what it declares: each row's parameters are
its ``Graph`` method's, in order, with the same defaults, each documented in the method's Args;
each keyword is used (read by its interpreter, or asking for an output); its roles exist."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap

import pytest
import torch

import cudnn_attn
from cudnn_attn.core.roles import ROLES
from cudnn_attn.core.validation import OUTPUT_ROLES
from cudnn_attn.recording import interpret
from cudnn_attn.recording.keywords import MaskKeywords
from cudnn_attn.recording.ops_table import OPS, OpSpec

SPECS = pytest.mark.parametrize("spec", OPS.values(), ids=list(OPS))


def own_parameters(method) -> tuple[list[str], list[tuple[str, object]], str | None]:
    """The method's parameters as written (``publishes_mask_keywords`` rewrites its signature):
    positional names after ``self``, keyword-only names with defaults, the ``**`` name."""
    code = method.__code__
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    keywords = [(name, method.__kwdefaults__[name]) for name in names[code.co_argcount :]]
    var_keyword = code.co_varnames[len(names)] if code.co_flags & inspect.CO_VARKEYWORDS else None
    return list(names[1 : code.co_argcount]), keywords, var_keyword


@SPECS
def test_each_row_is_its_methods_signature(spec: OpSpec):
    positional, keywords, var_keyword = own_parameters(getattr(cudnn_attn.Graph, spec.name))
    assert positional == [parameter for parameter, _ in spec.positional]
    assert keywords == list(spec.keywords)  # names, order and defaults
    assert var_keyword == "mask"  # the mask keywords, MaskKeywords's


@SPECS
def test_each_parameter_of_a_row_is_documented_in_its_methods_args(spec: OpSpec):
    doc = inspect.getdoc(getattr(cudnn_attn.Graph, spec.name)) or ""
    args = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^    (\*\*\w+|\w+):", args, re.M)
    assert documented == [*spec.arguments, "**mask"]


def test_the_other_parameters_of_sdpa_are_mask_keywords():
    doc = inspect.getdoc(cudnn_attn.Graph.sdpa) or ""
    listed = re.findall(r"^    (\w+) \(", doc.split("\nOther Parameters:\n", 1)[1].split("\n\n", 1)[0], re.M)
    fields = {f.name for f in dataclasses.fields(MaskKeywords)}
    assert listed and not set(listed) - fields, set(listed) - fields


def read_by_name(function) -> tuple[set[str], bool]:
    """The names ``function`` reads as ``arguments["name"]``, and whether it reads the
    positional tensors (``SPEC.tensors(arguments)``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = {
        node.slice.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "arguments"
        and isinstance(node.slice, ast.Constant)
    }
    tensors = any(isinstance(n, ast.Attribute) and n.attr == "tensors" for n in ast.walk(tree))
    return names, tensors


@SPECS
def test_each_keyword_of_a_row_is_used(spec: OpSpec):
    """Read by the op's interpreter, or asking for one of its outputs (``name`` names the node):
    a keyword added to a row and its signature but never interpreted fails here."""
    assert set(interpret.INTERPRETERS) == set(OPS)
    names, tensors = read_by_name(interpret.INTERPRETERS[spec.name])
    assert tensors
    asking = {k for output in spec.outputs for k in (output.flag, output.given) if k is not None}
    keywords = {keyword for keyword, _ in spec.keywords}
    assert keywords - names - asking == {"name"}
    assert names - keywords == {"mask"}  # nothing read that the row does not declare


@SPECS
def test_each_row_names_roles_its_op_has(spec: OpSpec):
    assert {role for _, role in spec.positional} <= set(spec.inputs) <= set(ROLES)
    assert {output.role for output in spec.outputs} <= set(OUTPUT_ROLES[spec.op])


def test_outputs_follow_the_keywords_that_ask_for_them():
    q = torch.randn(1, 2, 8, 16)
    dump = torch.empty(1, 2, 8, 8)
    d_bias = torch.empty(1, 2, 8, 8)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
        g.sdpa(q, q, q, is_inference=False, rng_dump=dump)
    assert [list(node.outputs) for node in g.nodes] == [["o"], ["o", "stats", "rng_dump"]]
    with cudnn_attn.Graph() as g:
        stats = torch.empty(1, 2, 8, 1)
        g.sdpa_backward(q, q, q, q, q, stats, bias_grad=True, attn_bias=d_bias)
        g.sdpa_backward(q, q, q, q, q, stats, dBias=d_bias, attn_bias=d_bias)
        g.sdpa_backward(q, q, q, q, q, stats)
    assert [list(node.outputs) for node in g.nodes] == [["grad_q", "grad_k", "grad_v", "grad_bias"]] * 2 + [
        ["grad_q", "grad_k", "grad_v"]
    ]
