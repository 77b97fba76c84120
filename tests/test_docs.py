"""The README and the pages under docs/: every ```python block runs, links resolve.

Skip rules (the same for every page): a block that imports torch or uses
``interop`` needs the torch extra (torch and eae_runtime) and is skipped
without it; a block that reads ``"../shared/..."`` (the stories260K model
beside the checkout) is skipped when that file is absent. Blocks run with
the repository root as the working directory, each in a fresh namespace.
"""

import glob
import os
import re

import pytest

from conftest import ROOT

README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
#: Pages other parts of the work write; links to them may dangle until they land.
PAGES_WRITTEN_ELSEWHERE = {"docs/scale-out.md"}
TEST_COMMAND = "python -m pytest -q -n 2 --dist worksteal"
README_LIMIT_BYTES = 15 * 1024


def _rel(path):
    return os.path.relpath(path, ROOT)


def python_blocks():
    """``(page, index, code)`` for every ```python block of every page."""
    out = []
    for page in PAGES:
        with open(page) as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
        out += [(_rel(page), i, code) for i, code in enumerate(blocks)]
    return out


BLOCKS = python_blocks()


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p}[{i}]" for p, i, _ in BLOCKS])
def test_doc_example_runs(page, index, code, monkeypatch):
    if "import torch" in code or "interop" in code:
        pytest.importorskip("torch")
        pytest.importorskip("eae_runtime")
    for path in re.findall(r'"(\.\./shared/[^"]+)"', code):
        if not os.path.exists(os.path.join(ROOT, path)):
            pytest.skip(f"{path} is absent (the {page} example reads it)")
    monkeypatch.chdir(ROOT)  # the examples use paths relative to the repository root
    exec(compile(code, f"{page}[python block {index}]", "exec"), {"__name__": f"doc_example_{index}"})


@pytest.mark.parametrize("page", [_rel(p) for p in PAGES])
def test_doc_links_resolve(page):
    """Relative links point at files of the repository (results files above all)."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(os.path.join(ROOT, page)), target))
        if not os.path.exists(path) and _rel(path) not in PAGES_WRITTEN_ELSEWHERE:
            missing.append(target)
    assert not missing, f"{page} links to files that do not exist: {missing}"


def test_every_docs_page_is_in_the_index_and_the_readme():
    readme = open(README).read()
    index = open(os.path.join(ROOT, "docs", "README.md")).read()
    pages = {_rel(p) for p in PAGES[1:]} | PAGES_WRITTEN_ELSEWHERE
    assert not [p for p in pages if f"]({p})" not in readme], "README misses a docs page link"
    assert not [p for p in pages - {"docs/README.md"} if f"]({os.path.basename(p)})" not in index], \
        "docs/README.md misses a page"


def test_readme_is_short():
    size = os.path.getsize(README)
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; keep it <= {README_LIMIT_BYTES} (move detail to docs/)"


def test_readme_has_the_two_set_up_commands():
    text = open(README).read()
    assert 'pip install -e ".[plot,tb]" && eae-jax train' in text
    assert f'pip install -e ".[torch,dev]" && {TEST_COMMAND}' in text
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert 'pip install -q -e ".[torch,dev]"' in ci and TEST_COMMAND in ci
