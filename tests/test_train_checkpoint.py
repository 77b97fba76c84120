"""Orbax checkpoints of the training state: round trip, errors that name the problem,
keep-last-N, atomic writes, background saves, and the ``.npz`` checkpoints of older runs."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import damage_checkpoint
from eae_jax.train import CheckpointError
from eae_jax.train.checkpoint import CheckpointStore
from eae_jax.train.errors import UnreadableCheckpointError


def _tree():
    return {"a": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones((4,), jnp.int32)}, "k": jax.random.key(3),
            "n": [jnp.float32(2.5)]}


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(str(tmp_path / "ckpts"), keep=2)
    yield s
    s.close()


def test_a_checkpoint_reads_back_and_misfits_are_named(store):
    tree = _tree()
    path = store.save(7, tree, {"note": "x"})
    store.wait()
    assert os.path.basename(path) == "ckpt_00000007" and store.latest() == path
    back, meta = store.restore(7, tree)
    assert meta == {"note": "x", "step": 7}
    np.testing.assert_array_equal(np.asarray(back["a"]), np.arange(6.0).reshape(2, 3))
    assert back["b"]["c"].dtype == jnp.int32 and float(back["n"][0]) == 2.5
    assert jnp.array_equal(jax.random.key_data(back["k"]), jax.random.key_data(tree["k"]))
    # every misfit listed at once, naming the checkpoint
    wrong = {"a": jnp.zeros((3, 2)), "b": {"c": tree["b"]["c"], "d": jnp.zeros(2)}, "n": tree["n"]}
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} does not fit the training state") as err:
        store.restore(7, wrong)
    lines = str(err.value).splitlines()[1:]
    assert sorted(line.strip() for line in lines) == ["['a']: shape (2, 3), expected (3, 2)", "missing ['b']['d']",
                                                      "unexpected k"]


def test_keep_drops_the_oldest_once_the_new_one_is_complete(store):
    for step in (1, 2, 3):
        store.save(step, {"w": jnp.full(3, float(step))})
    store.wait()
    assert [os.path.basename(p) for _, p in store.checkpoints()] == ["ckpt_00000002", "ckpt_00000003"]
    assert float(store.restore(3, {"w": jnp.zeros(3)})[0]["w"][0]) == 3.0


def test_a_killed_writers_temporary_is_never_resumed_and_is_cleaned_up(tmp_path):
    directory = str(tmp_path / "ckpts")
    first = CheckpointStore(directory)
    first.save(1, {"w": jnp.ones(3)})
    first.close()
    # What Orbax leaves when killed mid-write: the checkpoint under a temporary name.
    dead = os.path.join(directory, "ckpt_00000002.orbax-checkpoint-tmp-1733000000")
    os.makedirs(os.path.join(dead, "state"))
    second = CheckpointStore(directory)
    try:
        assert [s for s, _ in second.checkpoints()] == [1]
        second.save(3, {"w": jnp.zeros(3)})  # the next run's first save clears what can no longer finish
        second.wait()
        assert not os.path.exists(dead) and [s for s, _ in second.checkpoints()] == [1, 3]
    finally:
        second.close()


@pytest.mark.parametrize("how", ["random", "truncated", "data"])
def test_a_damaged_checkpoint_is_unreadable_and_named(store, how):
    tree = {"w": jnp.arange(64.0)}
    path = store.save(1, tree)
    store.wait()
    damage_checkpoint(path, how)
    with pytest.raises(UnreadableCheckpointError, match=f"cannot read checkpoint {path}"):
        store.restore(1, tree)


def test_save_returns_while_writing_and_keeps_the_values_it_was_given(store):
    big = jnp.arange(8 * 2**20, dtype=jnp.float32)  # 32 MiB: the write outlasts the call
    expected = np.asarray(big)
    store.save(1, {"w": big})
    assert store._manager.is_saving_in_progress()  # the step goes on while the files are written
    bumped = jax.jit(lambda x: x + 1, donate_argnums=0)(big)  # the next step may donate the state
    store.wait()
    np.testing.assert_array_equal(np.asarray(store.restore(1, {"w": jnp.zeros_like(bumped)})[0]["w"]), expected)


def _legacy_npz(path, tree, meta):
    """A checkpoint as runs wrote them before Orbax: leaves under their tree paths, metadata as JSON bytes."""
    arrays = {jax.tree_util.keystr(p): np.asarray(jax.random.key_data(x) if p[-1].key == "k" else x)
              for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    arrays["__metadata__.json"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **arrays)


def test_a_legacy_npz_checkpoint_is_resumed_like_the_rest(store):
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "k": jax.random.key(5)}
    _legacy_npz(os.path.join(store.directory, "ckpt_00000004.npz"), tree, {"step": 4, "config": {"lr": 0.1}})
    store.save(2, {"a": jnp.zeros((2, 3)), "k": jax.random.key(0)})
    store.wait()
    seen = []
    path, back, meta, unreadable = store.newest_readable(tree, check=lambda p, m: seen.append((p, m["step"])))
    assert path.endswith("ckpt_00000004.npz") and seen == [(path, 4)] and unreadable == []
    np.testing.assert_array_equal(np.asarray(back["a"]), np.asarray(tree["a"]))
    assert jnp.array_equal(jax.random.key_data(back["k"]), jax.random.key_data(tree["k"]))
    with pytest.raises(CheckpointError, match=r"ckpt_00000004.npz does not fit the training state:\s+"
                                              r"\['a'\]: shape \(2, 3\), expected \(6,\)"):
        store.restore_state(path, {"a": jnp.zeros(6), "k": tree["k"]})
