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
PAGES_WRITTEN_ELSEWHERE = set()
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


BENCHMARKS = os.path.join(ROOT, "docs", "benchmarks.md")


def _benchmark_tables():
    from conftest import load_experiment

    return load_experiment("bench_docs_tables")


def test_benchmark_tables_recompute_from_their_results():
    """Every marked table of docs/benchmarks.md is what its results file gives."""
    tdt = _benchmark_tables()
    text = open(BENCHMARKS).read()
    assert len(tdt.tables(text)) >= 5
    assert tdt.stale(text) == {}


def test_benchmark_tables_check_fails_on_an_edited_number():
    tdt = _benchmark_tables()
    text = open(BENCHMARKS).read()
    edited = text.replace("| T-compile / eae | time | 0.829 |", "| T-compile / eae | time | 0.830 |", 1)
    assert edited != text
    assert list(tdt.stale(edited)) == [f"ratios {p}" for k, p, _ in tdt.tables(text) if k == "ratios"][:1]


def test_benchmark_time_ratios_match_the_raw_step_times():
    """Each time ratio on the page against numpy over the results' per-step times:
    median over processes of each process's median, one over the other."""
    import json

    import numpy as np

    tdt = _benchmark_tables()
    checked = 0
    for kind, path, body in tdt.tables(open(BENCHMARKS).read()):
        if kind != "ratios":
            continue
        rows = json.load(open(os.path.join(ROOT, path)))["rows"]

        def stat(variant):
            meds = [np.median(r["times_ms"]) for r in rows
                    if r["variant"] == variant and r.get("role", "timed") == "timed" and r.get("status") == "ok"]
            return float(np.median(meds))

        for line in body.splitlines()[2:]:
            name, what, value = [c.strip() for c in line.strip("|").split("|")[:3]]
            if what == "time":
                a, b = name.split(" / ")
                assert float(value) == pytest.approx(stat(a) / stat(b), abs=6e-4), line
                checked += 1
    assert checked >= 10
