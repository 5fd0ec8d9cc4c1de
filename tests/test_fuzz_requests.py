"""A seeded fuzz campaign over every public attention op (see ``fuzz_requests.py``).

33 items of 100 seeds each: ``Graph.sdpa`` (dense and ragged), ``Graph.sdpa_backward``,
``Graph.sdpa_with_paged_cache``, ``cudnn_attn.sdpa``, FP8 (``Graph.sdpa_fp8``,
``cudnn_attn.sdpa_fp8``) and dropout checked statistically, valid and malformed requests. A valid
request must match the float64 oracle within its dtype's tolerance; a malformed one must raise a
library error; anything else (another exception, a hang, NaN, a wrong or unwritten result) is a
finding. Each item fails with its findings grouped by class, each with its seed; replay one with
``python tests/fuzz_requests.py <op> <seed>`` (or a whole item, in order: ``<op> <first>-<last>``).
The same requests on the GPU: ``test_gpu_fuzz.py``.
"""

from __future__ import annotations

import pytest
from fuzz_requests import CHUNK, MALFORMED, OPS, VALID, make_case, run_seed, summarize

ITEMS = [(op, chunk) for op, chunks in OPS.items() for chunk in range(chunks)]


@pytest.mark.parametrize(
    "op,chunk", ITEMS, ids=[f"{op}-seeds{c * CHUNK:04d}-{(c + 1) * CHUNK - 1:04d}" for op, c in ITEMS]
)
def test_requests_run_correctly_or_raise_a_library_error(op, chunk):
    findings = []
    for seed in range(chunk * CHUNK, (chunk + 1) * CHUNK):
        findings += run_seed(op, seed)[1]
    if findings:
        pytest.fail(
            f"{len(findings)} findings in {op} seeds {chunk * CHUNK}-{(chunk + 1) * CHUNK - 1} "
            f"(replay one: python tests/fuzz_requests.py {op} <seed>):\n{summarize(findings)}",
            pytrace=False,
        )


def test_the_campaign_covers_every_op_with_valid_and_malformed_requests():
    assert sum(OPS.values()) * CHUNK >= 3000
    for op in OPS:
        kinds = {make_case(op, seed).expect for seed in range(40)}
        assert {VALID, MALFORMED} <= kinds, f"{op}: {kinds}"
