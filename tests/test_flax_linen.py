"""`eae_jax.flax.linen.Reconstruct` against a remat'd scan of the same linen block.

The reference applies the block with plain autodiff: ``lax.scan`` over
``jax.checkpoint(block.apply)`` (what ``nn.remat`` is), layer i drawing
from ``split(make_rng('dropout'), length)[i]`` as the module documents, so
both draw the same masks. Masks are recorded each time a layer runs.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rel_err

from eae_jax import passes as P
from eae_jax.flax import linen as efl

D = 8
MASKS = []


def _record(mask):
    MASKS.append(np.asarray(mask).tobytes())


class TransformerBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.25, deterministic=False)(nn.SelfAttention(num_heads=2)(nn.LayerNorm()(x)))
        jax.debug.callback(_record, h != 0)
        x = x + h
        h = nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
        h = nn.Dropout(0.25, deterministic=False)(h)
        jax.debug.callback(_record, h != 0)
        return x + h


class BatchNormBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False, momentum=0.8)(nn.Dense(D)(x))
        return x + nn.Dropout(0.5, deterministic=False)(jnp.tanh(h))


class Reference(nn.Module):
    """The same stacked variables, applied by lax.scan over jax.checkpoint(block.apply)."""

    block: nn.Module
    length: int

    @nn.compact
    def __call__(self, x):
        keys = jax.random.split(self.make_rng("dropout"), self.length)
        variables = {c: v["layers"] for c, v in self.variables.items()}
        mutable = [c for c in variables if c != "params" and self.is_mutable_collection(c)]
        template = self.block.clone(parent=None)

        @jax.checkpoint
        def layer(v, h, k):
            return template.apply(v, h, rngs={"dropout": k}, mutable=mutable)

        def body(h, xs):
            h, updated = layer(*xs[:1], h, xs[1])
            return h, updated

        y, updated = jax.lax.scan(body, x, (variables, keys))
        for c, v in updated.items():
            self.put_variable(c, "layers", v)
        return y


def _loss_of(y):
    return jnp.mean(jnp.tanh(y) * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))


def _train(model, variables, x, steps, tx, with_carry):
    """``steps`` Adam steps; per step (loss, param grads, masks recorded); final variables."""
    params, state = variables["params"], {c: v for c, v in variables.items() if c != "params"}
    carries = state.pop(efl.CARRY_COLLECTION, None)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, carries, state, opt_state, key):
        def loss(p, c):
            coll = {"params": p, **state, **({efl.CARRY_COLLECTION: c} if with_carry else {})}
            y, updated = model.apply(coll, x, rngs={"dropout": key}, mutable=list(state))
            return _loss_of(y), updated

        (value, updated), (g_p, g_c) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, carries)
        updates, opt_state = tx.update(g_p, opt_state, params)
        if with_carry:
            carries, _ = efl.update_carries(carries, g_c)
        return optax.apply_updates(params, updates), carries, updated, opt_state, value, g_p

    out = []
    for t in range(steps):
        MASKS.clear()
        params, carries, state, opt_state, value, g_p = step(params, carries, state, opt_state,
                                                             jax.random.fold_in(jax.random.key(7), t))
        jax.block_until_ready(value)
        out.append((value, g_p, list(MASKS)))
    return out, {"params": params, **state}


def _init(block, x, length):
    return efl.Reconstruct(block, length=length, passes=P.statistics()).init(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)


def test_transformer_block_with_dropout_trains_like_a_remat_scan():
    depth, x = 4, jax.random.normal(jax.random.key(9), (2, 5, D))
    variables = _init(TransformerBlock(), x, depth)
    assert variables["params"]["layers"]["Dense_1"]["kernel"].shape == (depth, D, 2 * D)
    model = efl.Reconstruct(TransformerBlock(), length=depth, passes=P.statistics())
    ours, _ = _train(model, variables, x, 3, optax.adam(1e-2), with_carry=True)
    ref, _ = _train(Reference(TransformerBlock(), depth), {"params": variables["params"]}, x, 3, optax.adam(1e-2),
                    with_carry=False)
    seen = []
    for (loss, grads, masks), (ref_loss, ref_grads, _) in zip(ours, ref):
        assert rel_err(loss, ref_loss) <= 1e-6
        chex.assert_trees_all_close(grads, ref_grads, rtol=1e-6, atol=1e-6)
        assert len(masks) == 2 * 2 * depth  # forward and recomputation, two dropout draws per layer
        values, counts = np.unique(np.array(masks, dtype=object), return_counts=True)
        assert len(values) == 2 * depth and set(counts) == {2}
        seen.append(set(masks))
    assert not seen[0] & seen[1] and not seen[1] & seen[2], "a mask repeated between steps"


def test_batch_statistics_are_carried():
    x = jax.random.normal(jax.random.key(4), (6, D))
    variables = _init(BatchNormBlock(), x, 3)
    np.testing.assert_array_equal(variables["batch_stats"]["layers"]["BatchNorm_0"]["mean"], 0.0)  # as init left them
    model = efl.Reconstruct(BatchNormBlock(), length=3, passes=P.statistics())
    ours, final = _train(model, variables, x, 2, optax.sgd(0.1), with_carry=True)
    ref_vars = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
    ref, ref_final = _train(Reference(BatchNormBlock(), 3), ref_vars, x, 2, optax.sgd(0.1), with_carry=False)
    for (_, grads, _), (_, ref_grads, _) in zip(ours, ref):
        chex.assert_trees_all_close(grads, ref_grads, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(final["batch_stats"], ref_final["batch_stats"], rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(final["batch_stats"]["layers"]["BatchNorm_0"]["mean"]).min()) > 0
    # batch_stats not mutable in this apply: linen refuses the write, naming the collection
    with pytest.raises(Exception, match='collection "batch_stats" is immutable'):
        model.apply(variables, x, rngs={"dropout": jax.random.key(0)})


class Sowing(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.sow("intermediates", "hidden", x)
        return x + nn.Dense(D)(x)


def test_a_collection_made_while_running_is_refused_by_name():
    x = jnp.ones((2, D))
    model = efl.Reconstruct(Sowing(), length=2)
    variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params", efl.CARRY_COLLECTION}
    y = model.apply(variables, x)  # intermediates not mutable: sow does nothing, as in linen
    np.testing.assert_allclose(np.asarray(y), np.asarray(Reference(Sowing(), 2).apply(
        {"params": variables["params"]}, x, rngs={"dropout": jax.random.key(0)})), rtol=1e-6)
    with pytest.raises(ValueError, match=r"writes the collection\(s\) \['intermediates'\] while it runs"):
        model.apply(variables, x, mutable=["intermediates"])
    with pytest.raises(ValueError, match="apply with the 'adjoint_carry' collection"):
        efl.Reconstruct(Sowing(), length=2, passes=P.statistics()).apply({"params": variables["params"]}, x)
    with pytest.raises(ValueError, match="length must be an int >= 1"):
        efl.Reconstruct(Sowing(), length=0).init(jax.random.key(0), x)


def test_update_carries_checks_the_structure():
    carries = _init(Sowing(), jnp.ones((2, D)), 2)[efl.CARRY_COLLECTION]
    with pytest.raises(ValueError, match="do not have the carries' structure"):
        efl.update_carries(carries, {"other": carries["carry"]})
