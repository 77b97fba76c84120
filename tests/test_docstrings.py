"""Docstring examples of the public API: they run, and every public name has one.

`MODULES` is every module of ``eae_jax`` and ``interop``, found by walking
the packages, less `EXCLUDE`; a new module is checked without being listed,
so every public function and class gets a ``>>>`` example (optax style:
short, tiny shapes, imports shown) as it is written. Public means: a
function or class defined in the module (not imported into it) whose name
does not start with an underscore, private modules (``_util``) included;
methods are covered by their class's example. A package ``__init__`` that
only re-exports names has nothing to check.

Examples run with doctest (``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` on), in
a copy of the module's globals. Optional packages: ``interop`` is the torch
extra, so every module under ``interop`` is skipped as a whole when torch or
eae_runtime is missing, and its examples may use them freely (and
transformers, from the dev extra the suite runs with); modules outside
``interop`` must not need torch. A module whose import needs another extra
(`OPTIONAL_PACKAGES`) is skipped only when that package is absent. No
example uses ``+SKIP``.
"""

import doctest
import importlib
import inspect
import io
import os
import pkgutil
import sys

import pytest

from conftest import ROOT

#: Modules left out of the walk, one line each with the reason.
EXCLUDE = {
    "eae_jax.train.__main__",  # importing it runs a training
}
#: Top-level packages whose modules need the torch extra.
TORCH_PACKAGES = ("interop",)
#: Packages of the optional extras (pyproject.toml): a module whose import needs one is skipped when it is absent.
OPTIONAL_PACKAGES = ("torch", "eae_runtime", "safetensors", "transformers", "tokenizers", "tensorboardX",
                     "matplotlib")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def discover(packages=("eae_jax", "interop"), exclude=frozenset(EXCLUDE)):
    """Every module of ``packages`` under the repository root, packages themselves included, less ``exclude``.

    ``pkgutil.walk_packages`` imports the subpackages (to find their paths) but not the plain modules.
    """
    found = []
    for package in packages:
        path = [os.path.join(ROOT, *package.split("."))]
        found.append(package)
        found += [m.name for m in pkgutil.walk_packages(path, package + ".")]
    return tuple(sorted(name for name in found if name not in exclude))


MODULES = discover()


def _import(name):
    if name.split(".")[0] in TORCH_PACKAGES:
        pytest.importorskip("torch")
        pytest.importorskip("eae_runtime")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL_PACKAGES:
            pytest.skip(f"{name} needs the optional package {e.name}")
        raise


def public_members(module):
    """``(name, obj)`` for every public function and class defined in ``module``."""
    return [(name, obj) for name, obj in sorted(vars(module).items())
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and getattr(obj, "__module__", None) == module.__name__]


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_has_an_example(name):
    module = _import(name)
    missing = [n for n, obj in public_members(module) if ">>>" not in (inspect.getdoc(obj) or "")]
    assert not missing, f"{name}: no >>> example in the docstring of {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = _import(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=report.write)
    assert runner.tries > 0 or not public_members(module), f"{name} has no docstring examples"
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} examples failed in {name}:\n{report.getvalue()}"


def test_the_checks_see_a_missing_example():
    """A public function without an example is reported; a private one and an imported one are not."""
    import types

    module = types.ModuleType("fake_module")
    exec("import os\nfrom os.path import join\n"
         "def documented():\n    '''Doc.\n\n    >>> 1 + 1\n    2\n    '''\n"
         "def undocumented():\n    '''Doc without an example.'''\n"
         "def _private():\n    pass\n", module.__dict__)
    assert [n for n, _ in public_members(module)] == ["documented", "undocumented"]
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in doctest.DocTestFinder().find(module, "fake_module"):
        runner.run(test, out=lambda s: None)
    assert (runner.tries, runner.failures) == (1, 0)


def test_the_walk_finds_every_module_but_the_excluded():
    """Modules of every depth, private ones included, are found; exactly the excluded ones are left out."""
    for name in ("eae_jax", "eae_jax.passes._util", "eae_jax.train.loop", "eae_jax.fp8.quant", "interop.cli"):
        assert name in MODULES
    assert not set(MODULES) & EXCLUDE
    on_disk = {os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
               for package in ("eae_jax", "interop") for d, _, files in os.walk(os.path.join(ROOT, package))
               for f in files if f.endswith(".py")}
    assert set(MODULES) == on_disk - EXCLUDE
    assert discover(exclude=frozenset()) == tuple(sorted(on_disk))


def test_a_missing_optional_package_skips_but_a_missing_library_module_fails(tmp_path, monkeypatch):
    """Only an optional extra's absence is a skip: a broken import inside the library still fails."""
    (tmp_path / "needs_extra.py").write_text("import tensorboardX_not_installed.sub\n")
    (tmp_path / "needs_extra2.py").write_text("import matplotlib_missing\n")
    (tmp_path / "broken.py").write_text("import eae_jax.no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "OPTIONAL_PACKAGES", ("tensorboardX_not_installed",))
    with pytest.raises(pytest.skip.Exception, match="optional package tensorboardX_not_installed"):
        _import("needs_extra")
    with pytest.raises(ModuleNotFoundError):
        _import("needs_extra2")
    with pytest.raises(ModuleNotFoundError):
        _import("broken")
