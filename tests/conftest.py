"""Helpers shared by the test modules.

Each helper lives here once; test modules import them (``from conftest
import rel_err``) or use the fixtures by name.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
#: The real trained tiny LLaMA beside the checkout (never committed); EAE_STORIES260K points elsewhere
#: (a worktree whose ../shared is not the checkout's).
STORIES = os.path.abspath(os.environ.get("EAE_STORIES260K")
                          or os.path.join(ROOT, "..", "shared", "models", "stories260K.bin"))

#: Skip marker for tests that read stories260K.bin.
needs_stories = pytest.mark.skipif(
    not os.path.isfile(STORIES),
    reason=f"stories260K.bin not found at {STORIES} (see ../shared/models/README.md)",
)


def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (``||b||`` floored at 1e-30)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def has_gpu() -> bool:
    """Whether JAX sees a CUDA GPU."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


#: Marker pair for GPU-only tests: marked ``gpu`` and skipped without one.
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")]


def load_experiment(name: str):
    """Import ``experiments/<name>.py`` as a module (experiments is not a package)."""
    path = os.path.join(ROOT, "experiments", f"{name}.py")
    exp_dir = os.path.join(ROOT, "experiments")
    if exp_dir not in sys.path:
        sys.path.insert(0, exp_dir)  # experiments import their siblings (bench_common, ...)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The directory of a finished two-step ``eae-jax train`` run (tiny preset, batch 2, seq 16).

    Made once per session by the training command itself; tests only read it.
    """
    from eae_jax.train import TrainConfig, train

    out = str(tmp_path_factory.mktemp("tiny_run"))
    train(TrainConfig(preset="tiny", steps=2, batch=2, seq_len=16, out=out, log_every=1), log_fn=lambda m: None)
    return out
