"""Every ```python block of README.md runs and its assertions hold."""

import os
import re

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
README = os.path.join(ROOT, "README.md")


def python_blocks():
    text = open(README).read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index, capsys, monkeypatch):
    code = python_blocks()[index]
    if "import torch" in code or "interop" in code:
        pytest.importorskip("torch")
        pytest.importorskip("eae_runtime")
    for path in re.findall(r'"(\.\./shared/[^"]+)"', code):
        if not os.path.exists(os.path.join(ROOT, path)):
            pytest.skip(f"{path} is absent (the README example reads it)")
    monkeypatch.chdir(ROOT)  # the examples use paths relative to the repository root
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": f"readme_{index}"})


def test_readme_has_the_two_quick_start_commands():
    text = open(README).read()
    assert "eae-jax train" in text
    command = "python -m pytest -q -n 2 --dist worksteal"
    assert f'pip install -e ".[torch,dev]" && {command}' in text
    ci = open(os.path.join(os.path.dirname(__file__), "..", ".ci", "run")).read()
    assert 'pip install -q -e ".[torch,dev]"' in ci and command in ci
