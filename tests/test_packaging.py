"""What the installed package carries: type hints (PEP 561 ``py.typed``) and precise annotations."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import typing
import zipfile

import pytest

from conftest import ROOT


def _setuptools_builds_here() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 77  # pyproject's build requirement


@pytest.mark.skipif(not _setuptools_builds_here(), reason="needs setuptools >= 77 to build the wheel offline")
def test_the_wheel_ships_py_typed_and_the_flax_front_ends(tmp_path):
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for package in ("eae_jax", "interop"):
        shutil.copytree(os.path.join(ROOT, package), src / package, ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (wheel,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"eae_jax/py.typed", "interop/py.typed", "eae_jax/flax/nnx.py", "eae_jax/flax/linen.py",
            "interop/safetensors_numpy.py"} <= names


def test_reconstruct_arguments_are_typed_precisely():
    import eae_jax
    from eae_jax.reconstruct import Storage

    hints = typing.get_type_hints(eae_jax.reconstruct)
    loose = [name for name, hint in hints.items() if hint is typing.Any]
    assert not loose, f"reconstruct's {loose} are typed Any"
    assert Storage in typing.get_args(hints["storage"])
    assert typing.Literal["scan", "unrolled"] in typing.get_args(hints["offload"])
    assert hints["return"] is eae_jax.Reconstructed
