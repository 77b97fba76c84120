"""Docstring examples of the public API: they run, and every public name has one.

`MODULES` lists the modules checked, explicitly; add a module once every
public function and class defined in it has a ``>>>`` example (optax style:
short, tiny shapes, imports shown). Public means: a function or class
defined in the module (not imported into it) whose name does not start with
an underscore; methods are covered by their class's example.

Examples run with doctest (``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` on), in
a copy of the module's globals. Torch: ``interop`` is the torch extra, so
every module under ``interop`` is skipped as a whole when torch or
eae_runtime is missing, and its examples may use them freely (and
transformers, from the dev extra the suite runs with); modules outside
``interop`` must not need torch. No example uses ``+SKIP``.
"""

import doctest
import importlib
import inspect
import io

import pytest

MODULES = (
    "eae_jax.blocks.attention",
    "eae_jax.blocks.linear",
    "eae_jax.blocks.norm",
    "eae_jax.blocks.rope",
    "eae_jax.blocks.swiglu",
    "eae_jax.blocks.transformer",
    "eae_jax.carry",
    "eae_jax.export",
    "eae_jax.flax.linen",
    "eae_jax.flax.nnx",
    "eae_jax.generate",
    "eae_jax.grad_slots",
    "eae_jax.model_files",
    "eae_jax.models.convert",
    "eae_jax.models.decode",
    "eae_jax.models.sampling",
    "eae_jax.observe",
    "eae_jax.offload",
    "eae_jax.passes.optax_transform",
    "eae_jax.passes.schedule",
    "eae_jax.reconstruct.adjoint",
    "eae_jax.reconstruct.host",
    "eae_jax.reconstruct.policy",
    "eae_jax.reconstruct.slots",
    "eae_jax.reconstruct.stack",
    "eae_jax.reconstruct.state",
    "eae_jax.reconstruct.storage",
    "eae_jax.text.corpus",
    "eae_jax.text.llama2c_tokenizer",
    "eae_jax.text.tokenizer",
    "eae_jax.train.config",
    "eae_jax.train.data",
    "eae_jax.train.metrics",
    "eae_jax.train.monitor",
    "eae_jax.train.profile",
    "eae_jax.train.progress",
    "eae_jax.train.report",
    "eae_jax.train.shapes",
    "eae_jax.train.sources",
    "interop.auto",
    "interop.generate",
    "interop.hf_llama",
    "interop.imported",
    "interop.layout",
    "interop.llama2c",
    "interop.reference",
    "interop.safe_load",
    "interop.safetensors_numpy",
    "interop.tensors",
    "interop.torch_blocks",
)
#: Top-level packages whose modules need the torch extra.
TORCH_PACKAGES = ("interop",)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _import(name):
    if name.split(".")[0] in TORCH_PACKAGES:
        pytest.importorskip("torch")
        pytest.importorskip("eae_runtime")
    return importlib.import_module(name)


def public_members(module):
    """``(name, obj)`` for every public function and class defined in ``module``."""
    return [(name, obj) for name, obj in sorted(vars(module).items())
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and getattr(obj, "__module__", None) == module.__name__]


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_has_an_example(name):
    module = _import(name)
    members = public_members(module)
    assert members, f"{name} defines no public function or class; drop it from MODULES"
    missing = [n for n, obj in members if ">>>" not in (inspect.getdoc(obj) or "")]
    assert not missing, f"{name}: no >>> example in the docstring of {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = _import(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=report.write)
    assert runner.tries > 0, f"{name} has no docstring examples"
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
