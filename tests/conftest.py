"""Helpers shared by the test modules.

Each helper lives here once; test modules import them (``from conftest
import rel_err``) or use the fixtures by name.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import chex
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


def assert_grads_close(got, want, rtol: float, atol: float) -> None:
    """`chex.assert_trees_all_close` for gradient trees that may hold float0
    leaves (the gradients of int, bool or PRNG-key params): those must match
    in shape and dtype, the others in value."""
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)

    def values(tree):
        return jax.tree_util.tree_map(lambda a: None if a.dtype == jax.dtypes.float0 else a, tree)

    chex.assert_trees_all_close(values(got), values(want), rtol=rtol, atol=atol)


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


@pytest.fixture
def fast_compiles():
    """XLA without most optimizations, for tests that check that a run goes through (or
    fails as it should), not its speed: compiles take about a third of the time."""
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", False)


def quiet(*args, **kwargs):
    """A log function that drops everything (``train(..., log_fn=quiet)``)."""


#: The smallest training config the loop tests use: tiny preset, 2 x 8 tokens, a record per step.
TINY_TRAIN = dict(preset="tiny", batch=2, seq_len=8, warmup=0, log_every=1)


def hf_config_dict(**overrides) -> dict:
    """A transformers-5 style LLaMA config.json dict (rope_parameters); no transformers needed."""
    cfg = {"model_type": "llama", "vocab_size": 37, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "attention_bias": False,
           "mlp_bias": False, "head_dim": 8}
    cfg.update(overrides)
    return cfg


def hf_params(cfg: dict):
    """``(params, LMConfig)`` of random LM params for a config.json dict (needs interop's torch extra)."""
    from eae_jax.models import init_lm
    from interop.hf_llama import lm_config_from_hf

    lm = lm_config_from_hf(cfg)
    return init_lm(jax.random.key(0), lm), lm


def small_llama2c_bytes(tmp_path, version: int, shared: bool = True) -> bytes:
    """The bytes of a one-layer llama2.c export (``version`` 0 or 1) of random params."""
    import interop
    from eae_jax.blocks import BlockConfig
    from eae_jax.models import LMConfig, init_lm

    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=7), tie_embeddings=shared)
    path = str(tmp_path / f"m{version}.bin")
    interop.save_llama2c_bin(path, init_lm(jax.random.key(0), lm), lm, version=version)
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The directory of a finished two-step ``eae-jax train`` run (tiny preset, batch 2, seq 16).

    Made once per session by the training command itself; tests only read it.
    """
    from eae_jax.train import TrainConfig, train

    out = str(tmp_path_factory.mktemp("tiny_run"))
    train(TrainConfig(preset="tiny", steps=2, batch=2, seq_len=16, out=out, log_every=1), log_fn=lambda m: None)
    return out


def damage_checkpoint(path: str, how: str) -> dict:
    """Damage the checkpoint directory ``path`` in place; returns ``{relative path: new bytes}``.

    ``random``: every file replaced by random bytes; ``truncated``: every file
    cut to half its length; ``data``: only the array data files (under the
    ``state`` item's ``d/``) replaced by random bytes, the metadata intact.
    """
    rng = np.random.default_rng(0)
    written = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if how == "data" and not rel.startswith(os.path.join("state", "d") + os.sep):
                continue
            data = open(full, "rb").read()
            new = data[: len(data) // 2] if how == "truncated" else rng.bytes(max(len(data), 16))
            open(full, "wb").write(new)
            written[rel] = new
    if not written:
        raise ValueError(f"nothing to damage in {path} ({how})")
    return written


def run_worker(mode: str, tmp_path, devices: int = 8, timeout: float = 600, env: dict = None) -> dict:
    """Run ``tests/parallel_worker.py MODE`` in a fresh process with ``devices`` CPU
    devices (XLA_FLAGS must be set before jax is imported) and return the JSON it prints."""
    import json
    import subprocess

    full_env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                    PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "parallel_worker.py"), mode, str(tmp_path)],
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"parallel_worker {mode} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
