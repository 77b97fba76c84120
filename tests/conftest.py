"""Helpers shared by the test modules.

Each helper lives here once; test modules import them (``from conftest
import rel_err``) or use the fixtures by name.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def compiling_fast():
    """XLA without most optimizations inside the block (`fast_compiles` for a module- or
    session-scoped fixture)."""
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


@pytest.fixture
def fast_compiles():
    """XLA without most optimizations, for tests that check that a run goes through (or
    fails as it should), not its speed: compiles take about a third of the time."""
    with compiling_fast():
        yield


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


#: llama2.c's ``.bin`` tensors in file order, from its export.py (``legacy_export``: version 0,
#: ``version1_export``: version 1) and run.c's ``memory_map_weights``, written here from the format,
#: not from interop's reader. Names are run.c's; ``wcls`` follows only when the classifier is untied.
LLAMA2C_BIN_ORDER = {
    0: ("token_embedding_table", "rms_att_weight", "wq", "wk", "wv", "wo", "rms_ffn_weight", "w1", "w2", "w3",
        "rms_final_weight", "freq_cis_real", "freq_cis_imag"),
    1: ("rms_att_weight", "rms_ffn_weight", "rms_final_weight", "token_embedding_table", "wq", "wk", "wv", "wo",
        "w1", "w2", "w3"),
}


def llama2c_spec_tensors(dim=16, hidden=20, layers=1, heads=4, kv=2, vocab=11, seq=7, shared=True):
    """``(header, tensors)`` of a llama2.c model whose every tensor holds values no other tensor holds.

    ``header`` is run.c's Config ``(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)``;
    ``tensors`` maps run.c's names to float32 arrays in stored shape (layer outermost, matrices
    ``[out, in]``): tensor ``k`` holds ``k + i / 1024`` (exact in float32), so a swapped pair of equal
    shape is seen. The RoPE tables are model.py's ``precompute_freqs_cis`` (base 10000; needs torch).
    """
    hd = dim // heads
    shapes = {"token_embedding_table": (vocab, dim), "rms_att_weight": (layers, dim),
              "wq": (layers, dim, dim), "wk": (layers, kv * hd, dim), "wv": (layers, kv * hd, dim),
              "wo": (layers, dim, dim), "rms_ffn_weight": (layers, dim), "w1": (layers, hidden, dim),
              "w2": (layers, dim, hidden), "w3": (layers, hidden, dim), "rms_final_weight": (dim,)}
    if not shared:
        shapes["wcls"] = (vocab, dim)
    tensors = {}
    for k, (name, shape) in enumerate(shapes.items(), start=1):
        n = int(np.prod(shape))
        assert n < 1024, "values k + i/1024 must stay distinct between tensors"
        tensors[name] = (np.float32(k) + np.arange(n, dtype=np.float32) / np.float32(1024)).reshape(shape)
    import torch  # model.py's float32 torch arithmetic, so the tables are the bits llama2.c writes

    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    angles = torch.outer(torch.arange(seq), freqs).float()
    tensors["freq_cis_real"], tensors["freq_cis_imag"] = torch.cos(angles).numpy(), torch.sin(angles).numpy()
    return (dim, hidden, layers, heads, kv, vocab, seq), tensors


def llama2c_bin_bytes(header, tensors, version: int, order=None) -> bytes:
    """A llama2.c ``.bin`` written with ``struct`` after export.py: the header, then ``order``'s tensors.

    Version 0: 7 little-endian int32, vocab_size negated when a ``wcls`` follows. Version 1: uint32
    magic ``ak42``, int32 version, the 7 int32, a uint8 shared-classifier flag, zeros to byte 256.
    ``order`` defaults to `LLAMA2C_BIN_ORDER` (a test may swap two names to plant a bug).
    """
    import struct

    dim, hidden, layers, heads, kv, vocab, seq = header
    shared = "wcls" not in tensors
    if version == 0:
        out = struct.pack("<7i", dim, hidden, layers, heads, kv, vocab if shared else -vocab, seq)
    else:
        out = struct.pack("<Ii7iB", 0x616B3432, 1, dim, hidden, layers, heads, kv, vocab, seq, int(shared))
        out += b"\0" * (256 - len(out))
    names = list(order or LLAMA2C_BIN_ORDER[version]) + ([] if shared else ["wcls"])
    for name in names:
        out += struct.pack(f"<{tensors[name].size}f", *tensors[name].ravel().tolist())
    return out


def small_llama2c_bytes(tmp_path, version: int, shared: bool = True) -> bytes:
    """The bytes of a one-layer llama2.c export (``version`` 0 or 1), also written to ``tmp_path/m{version}.bin``.

    Written from the format (`llama2c_bin_bytes`), not by interop: dim 16, hidden 20, 4 heads, 2 kv heads,
    vocab 11, seq_len 7.
    """
    data = llama2c_bin_bytes(*llama2c_spec_tensors(shared=shared), version)
    (tmp_path / f"m{version}.bin").write_bytes(data)
    return data


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The directory of a finished two-step ``eae-jax train`` run (tiny preset, batch 2, seq 16).

    Made once per session by the training command itself; tests only read it.
    """
    from eae_jax.train import TrainConfig, train

    out = str(tmp_path_factory.mktemp("tiny_run"))
    with compiling_fast():  # its readers check what it wrote, not how fast it trained
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

    flags = f"--xla_force_host_platform_device_count={devices}"
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 8):
        # XLA:CPU aborts a collective whose devices do not all arrive within 40 s: on two
        # shared cores under load (pytest -n 2) one device thread can wait that long.
        flags += (f" --xla_cpu_collective_call_terminate_timeout_seconds={int(timeout)}"
                  " --xla_cpu_collective_call_warn_stuck_timeout_seconds=120")
    full_env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
                    PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "parallel_worker.py"), mode, str(tmp_path)],
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"parallel_worker {mode} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
@pytest.fixture(autouse=True)
def _fresh_jit_caches_for_mutmut_stats():
    """mutmut (docs/testing.md) maps each test to the library functions it calls by recording the
    calls, but a jit cache hit skips the Python call: during its stats run every test starts with
    empty caches, so a test is mapped to every function it runs."""
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        jax.clear_caches()
    yield
