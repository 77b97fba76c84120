"""`eae_jax.flax.Reconstruct` (NNX) against ``nnx.scan(nnx.remat(...))`` on the same layers.

Layers are stacked with ``nnx.split_rngs`` + ``nnx.vmap``; both models are
built from the same seeds, so they hold the same params and RNG streams and
draw the same dropout masks. Masks are recorded with a debug callback each
time a layer runs: in the forward and in the backward's recomputation.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rel_err
from flax import nnx

import eae_jax.flax as ef
from eae_jax import passes as P
from eae_jax.reconstruct import GradSlots, Host, HostUnrolled, OnDevice, Policy

D = 8
MASKS = []  # (dropout mask bytes) of every layer call, forward and recomputation


def _record(mask):
    MASKS.append(np.asarray(mask).tobytes())


class TransformerBlock(nnx.Module):
    """Pre-norm attention + MLP, dropout on both residual branches (one RNG stream, drawn twice per call)."""

    def __init__(self, rngs):
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
        h = self.drop(self.attn(self.norm1(x)))
        jax.debug.callback(_record, h != 0)
        x = x + h
        h = self.drop(self.down(nnx.gelu(self.up(self.norm2(x)))))
        jax.debug.callback(_record, h != 0)
        return x + h


class DropoutLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.linear(x)))


class BatchNormLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.norm = nnx.BatchNorm(D, momentum=0.8, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.norm(self.linear(x)))


def stacked(layer_cls, depth, seed=0):
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return layer_cls(rngs)

    return make(nnx.Rngs(seed, dropout=seed + 1))


class ScanRemat(nnx.Module):
    """The reference: ``nnx.scan(nnx.remat(...))`` over the same stacked layers."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def forward(layer, h):
            return layer(h)

        return forward(self.layers, x)


def _loss(model, x):
    y = model(x)
    return jnp.mean(jnp.tanh(y) * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))


@nnx.jit
def ours_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, ef.PARAMS_AND_CARRIES))(model, x)
    optimizer.update(model, grads)
    stats = ef.update_carries(model, grads)
    return loss, nnx.state(grads, nnx.Param), stats


@nnx.jit
def ref_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(_loss)(model, x)
    optimizer.update(model, grads)
    return loss, grads


def _pure(state):
    return nnx.to_pure_dict(state)


def _counts(model):
    return _pure(nnx.state(model.layers, nnx.RngCount))


def test_transformer_block_with_dropout_trains_like_scan_of_remat():
    depth, x = 4, jax.random.normal(jax.random.key(9), (2, 5, D))
    ours = ef.Reconstruct(stacked(TransformerBlock, depth), passes=P.statistics(), input_spec=x)
    ref = ScanRemat(stacked(TransformerBlock, depth))
    opt_ours = nnx.Optimizer(ours, optax.adam(1e-2), wrt=nnx.Param)
    opt_ref = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    seen = []
    for step in range(3):
        MASKS.clear()
        loss, grads, stats = ours_step(ours, opt_ours, x)
        jax.block_until_ready(loss)
        masks = list(MASKS)
        ref_loss, ref_grads = ref_step(ref, opt_ref, x)
        assert rel_err(loss, ref_loss) <= 1e-6
        chex.assert_trees_all_close(_pure(grads)["layers"], _pure(ref_grads)["layers"], rtol=1e-6, atol=1e-6)
        # every layer ran twice (forward, recomputation), two dropout draws each, on the same masks both times
        assert len(masks) == 2 * 2 * depth
        values, counts = np.unique(np.array(masks, dtype=object), return_counts=True)
        assert len(values) == 2 * depth and set(counts) == {2}
        seen.append(set(masks))
        chex.assert_trees_all_equal(_counts(ours), _counts(ref))
        assert int(stats[()]["step"]) == step and float(stats[()]["calls"]) == 1.0
    assert not seen[0] & seen[1] and not seen[1] & seen[2], "a mask repeated between steps"
    assert (np.asarray(_counts(ours)["drop"]["rngs"]["count"]) == 3 * 2).all()
    chex.assert_trees_all_close(_pure(nnx.state(ours.layers, nnx.Param)), _pure(nnx.state(ref.layers, nnx.Param)),
                                rtol=1e-5, atol=1e-6)


STORAGES = {"grad_slots": GradSlots(), "device": OnDevice(), "policy": Policy("dots"), "host": Host(),
            "host_unrolled": HostUnrolled()}


@pytest.mark.parametrize("storage", list(STORAGES))
def test_a_typed_key_layer_runs_under_every_storage(storage):
    x = jax.random.normal(jax.random.key(3), (3, D))
    ours = ef.Reconstruct(stacked(DropoutLayer, 3), storage=STORAGES[storage])
    ref = ScanRemat(stacked(DropoutLayer, 3))
    assert [s.kind for s in ours.stack().storages(nnx.state(ours.layers), x)] == [STORAGES[storage].kind]
    grads = nnx.jit(nnx.grad(_loss))(ours, x)
    ref_grads = nnx.jit(nnx.grad(_loss))(ref, x)
    chex.assert_trees_all_close(_pure(grads)["layers"], _pure(ref_grads)["layers"], rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_equal(_counts(ours), _counts(ref))
    assert np.asarray(_counts(ours)["drop"]["rngs"]["count"]).tolist() == [1] * 3


def test_batch_statistics_are_carried():
    x = jax.random.normal(jax.random.key(4), (6, D))
    ours, ref = ef.Reconstruct(stacked(BatchNormLayer, 3)), ScanRemat(stacked(BatchNormLayer, 3))
    opt_ours = nnx.Optimizer(ours, optax.sgd(0.1), wrt=nnx.Param)
    opt_ref = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    for _ in range(2):
        grads = nnx.jit(lambda m, o: (g := nnx.grad(_loss)(m, x), o.update(m, g))[0])(ours, opt_ours)
        ref_grads = ref_step(ref, opt_ref, x)[1]
        chex.assert_trees_all_close(_pure(grads)["layers"], _pure(ref_grads)["layers"], rtol=1e-6, atol=1e-6)
    stats, ref_stats = _pure(nnx.state(ours, nnx.BatchStat)), _pure(nnx.state(ref, nnx.BatchStat))
    chex.assert_trees_all_close(stats, ref_stats, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(stats["layers"]["norm"]["mean"]).min()) > 0  # moved off their init
    ours.eval()  # running averages: nothing to update, and the stack still runs
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(ScanRemat(ours.layers)(x)), rtol=1e-6, atol=1e-6)


class SowingLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        self.sow(nnx.Intermediate, "hidden", x)
        return x + self.linear(x)


class ParamWritingLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        self.linear.bias[...] = self.linear.bias[...] + 1.0
        return x + self.linear(x)


def test_state_that_cannot_be_carried_is_refused_by_name():
    x = jnp.ones((2, D))
    with pytest.raises(ValueError, match=r"creates hidden \(Intermediate\)"):
        ef.Reconstruct(stacked(SowingLayer, 2))(x)
    with pytest.raises(ValueError, match=r"updates linear/bias \(Param\) while it runs"):
        ef.Reconstruct(stacked(ParamWritingLayer, 2))(x)
    unstacked = nnx.Linear(D, D, rngs=nnx.Rngs(0))  # no depth axis: the kernel's first axis is read as the depth
    with pytest.raises(ValueError, match="it was read as 8 blocks: if that is not the depth, the params lack it"):
        ef.Reconstruct(unstacked)(x)
    with pytest.raises(ValueError, match="the passes keep their state in the carry; give input_spec="):
        ef.Reconstruct(stacked(DropoutLayer, 2), passes=P.clip_by_norm(1.0))(x)
    with pytest.raises(TypeError, match="layers must be an nnx.Module"):
        ef.Reconstruct([1, 2])


def test_the_carry_gradient_brings_the_pass_state_out():
    x = jax.random.normal(jax.random.key(5), (3, D))
    model = ef.Reconstruct(stacked(DropoutLayer, 3), passes=P.chain(P.statistics(), P.gaussian_noise(0.1)),
                           input_spec=x, key=4)
    key_before = model.stack().state(model.carry.get_value())["top"][1].key
    y = nnx.jit(lambda m: m(x))(ScanRemat(stacked(DropoutLayer, 3)))
    dy = jax.grad(lambda y: jnp.mean(jnp.tanh(y) * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))))(y)
    grads = nnx.jit(nnx.grad(_loss, argnums=nnx.DiffState(0, ef.PARAMS_AND_CARRIES)))(model, x)
    stats = nnx.jit(ef.update_carries)(model, grads)[()]
    np.testing.assert_allclose(float(stats["adjoint_norm"][-1]), float(jnp.linalg.norm(dy)), rtol=1e-5)
    state = model.stack().state(model.carry.get_value())
    assert int(jax.random.key_data(state["top"][1].key)[0]) != int(jax.random.key_data(key_before)[0])
    np.testing.assert_allclose(float(state["top"][0].norm), float(jnp.linalg.norm(dy)), rtol=1e-5)
    with pytest.raises(ValueError, match="no carry gradient at 'carry'; differentiate with nnx.DiffState"):
        ef.update_carries(model, nnx.state(grads, nnx.Param))
    with pytest.raises(ValueError, match="has no eae_jax.flax.Reconstruct with a carry"):
        ef.update_carries(ScanRemat(stacked(DropoutLayer, 2)), grads)


class MaskedLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x, mask):
        return x + mask * jnp.tanh(self.linear(x))


def test_more_arguments_reach_every_layer_as_constants():
    x, mask = jax.random.normal(jax.random.key(6), (3, D)), jnp.array([1.0, 0.0, 1.0])[:, None]
    model = ef.Reconstruct(stacked(MaskedLayer, 3))

    @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
    def reference(layer, h, m):
        return layer(h, m)

    loss = lambda m, x, mask: jnp.sum(jnp.sin(m(x, mask)))  # noqa: E731
    grads, g_mask = nnx.jit(nnx.grad(loss, argnums=(0, 2)))(model, x, mask)
    ref = nnx.jit(nnx.grad(lambda m, x: jnp.sum(jnp.sin(reference(m.layers, x, mask)))))(model, x)
    chex.assert_trees_all_close(_pure(grads)["layers"], _pure(ref)["layers"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(g_mask), 0.0)  # constant to the backward, like lax.stop_gradient
