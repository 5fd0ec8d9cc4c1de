"""Every python block in the docs runs as written.

Each page's blocks run in order in one namespace (a page may define its inputs once and use
them below), on the CPU here; a block whose preceding line is ``<!-- gpu -->`` needs a CUDA GPU
and runs in the GPU suite. ``<!-- no-run: why -->`` marks a block that needs what a test
process cannot give (several processes, a model download), saying why and where the same
code does run; the test holds every such mark to a reason.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK = re.compile(r"(?:^(<!-- [^\n]* -->)\n)?^```python\n(.*?)^```", re.M | re.S)
NO_RUN = re.compile(r"<!-- no-run: (.{20,}) -->")  # a reason of a few words at least


def blocks(page: Path) -> list[tuple[str | None, str]]:
    """``(mark, code)`` for each python block of ``page``, in order."""
    return [(mark or None, code) for mark, code in BLOCK.findall(page.read_text())]


def run_page(page: Path, on_gpu: bool) -> int:
    """Runs ``page``'s blocks (the GPU-marked ones only when ``on_gpu``); returns how many ran."""
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for i, (mark, code) in enumerate(blocks(page)):
        if mark is not None and NO_RUN.fullmatch(mark):
            continue
        if mark == "<!-- gpu -->" and not on_gpu:
            continue
        exec(compile(code, f"{page.relative_to(ROOT)} block {i + 1}", "exec"), namespace)  # noqa: S102
        ran += 1
    return ran


PAGES_WITH_CODE = [p for p in PAGES if blocks(p)]


@pytest.fixture(autouse=True)
def logger_as_it_was():
    """A page may set the package's log level (the debugging page does): later tests see it unset."""
    logger = logging.getLogger("cudnn_attn")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in PAGES_WITH_CODE])
def test_page_runs_on_the_cpu(page, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path))  # the docs' plan stores stay in the test's folder
    monkeypatch.chdir(ROOT)
    run_page(page, on_gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in PAGES_WITH_CODE])
def test_page_runs_on_a_gpu(page, monkeypatch, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.chdir(ROOT)
    run_page(page, on_gpu=True)


def test_every_mark_is_known_and_every_skip_says_why():
    for page in PAGES:
        for mark, _ in blocks(page):
            if mark is None or mark == "<!-- gpu -->":
                continue
            assert NO_RUN.fullmatch(mark), (
                f"{page.relative_to(ROOT)}: {mark!r} is neither <!-- gpu --> nor a no-run with its reason"
            )


def test_the_blocks_are_found():
    """The pattern finds blocks, marks included (a pattern that matched nothing would pass every page)."""
    assert sum(len(blocks(p)) for p in PAGES) >= 30
    assert any(mark == "<!-- gpu -->" for p in PAGES for mark, _ in blocks(p))
