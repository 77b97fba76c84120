"""Every boundary storage of `eae_jax.reconstruct` against an independent reference.

Each storage runs each stack shape (a scanned run, a list of single blocks,
a heterogeneous stack fed int tokens, a side input) and must give plain
`jax.grad`'s gradients; with a pass chain, the pass state and statistics of
a per-block VJP chain written here; with bf16 boundaries, the gradients of
recomputing every block from its rounded input. The block draws a dropout
mask from a typed PRNG key in its params and reads an int counter there,
as a flax ``nnx.Dropout`` layer's state does: those leaves get the float0
gradients plain ``jax.grad(allow_int=True)`` gives them.
"""

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_grads_close, rel_err
from jax.sharding import PartitionSpec

import eae_jax
from eae_jax import passes as P
from eae_jax.parallel import Sharded, make_mesh
from eae_jax.reconstruct import (GradSlots, Host, HostUnrolled, OnDevice, Policy, Runs, Scan, Segment,
                                 SegmentLayout, Storage)
from eae_jax.reconstruct.policy import resolve_policy, split_vjp
from eae_jax.train.profile import stage_of

STORAGES = {
    "device": OnDevice(),
    "grad_slots": GradSlots(),
    "policy": Policy("dots"),
    "host": Host(),
    "host_unrolled": HostUnrolled(),
}


def mlp(p, h):
    """A residual MLP block with dropout (mask from the key ``p['rng']``) and an int counter ``p['n']``."""
    keep = jax.random.bernoulli(p["rng"], 0.75, h.shape)
    return h + jnp.where(keep, jnp.tanh(h @ p["w1"]) @ p["w2"], 0.0) * (p["s"] + 0.25 * p["n"])


def mlp_params(key, depth=None):
    lead = () if depth is None else (depth,)
    k = jax.random.split(key, 3)
    return {"w1": 0.4 * jax.random.normal(k[0], lead + (8, 12)), "w2": 0.4 * jax.random.normal(k[1], lead + (12, 8)),
            "s": jnp.broadcast_to(jnp.linspace(0.5, 1.5, 8), lead + (8,)),
            "rng": k[2] if depth is None else jax.random.split(k[2], depth),
            "n": jnp.int32(1) if depth is None else jnp.arange(depth, dtype=jnp.int32)}


def embed(table, tokens):
    return jnp.take(table, tokens, axis=0)


def head(w, h):
    return h @ w


def gated(p, h, gate):
    return mlp(p, h) * gate[:, None]


def gated_embed(table, tokens, gate):
    return embed(table, tokens) * gate[:, None]


def _rows(p, i):
    return jax.tree_util.tree_map(lambda a: a[i], p)


@dataclasses.dataclass(frozen=True)
class Case:
    """A stack: ``blocks`` for `reconstruct`, its params and inputs, and the
    same model as a plain list of ``(block fn, one block's params)``."""

    blocks: object
    params: object
    x: jax.Array
    side: object = None

    def flat(self, params):
        items = self.blocks if isinstance(self.blocks, list) else [Scan(self.blocks)]
        plist = params if isinstance(self.blocks, list) else [params]
        out = []
        for item, p in zip(items, plist):
            if isinstance(item, Scan):
                depth = jax.tree_util.tree_leaves(p)[0].shape[0]
                out += [(item.fn, _rows(p, i)) for i in range(depth)]
            else:
                out.append((item, p))
        return out

    def plain(self, params, x):
        for fn, p in self.flat(params):
            x = fn(p, x) if self.side is None else fn(p, x, self.side)
        return x


def _case(name) -> Case:
    k = jax.random.split(jax.random.key(11), 8)
    x = jax.random.normal(k[0], (3, 8))
    if name == "scanned":
        return Case(mlp, mlp_params(k[1], 3), x)
    if name == "blocks":
        return Case([mlp, mlp, mlp], [mlp_params(kk) for kk in jax.random.split(k[2], 3)], x)
    if name == "hetero_int_input":
        return Case([embed, Scan(mlp, "body"), mlp, head],
                    [jax.random.normal(k[3], (11, 8)), mlp_params(k[4], 2), mlp_params(k[5]),
                     0.5 * jax.random.normal(k[6], (8, 5))], jnp.array([3, 0, 9], jnp.int32))
    if name == "side":
        return Case(gated, mlp_params(k[1], 3), x, side=jnp.array([0.5, 1.5, 1.0]))
    if name == "int_input_side":  # the side input reaches a block fed int tokens too
        return Case([gated_embed, Scan(gated, "body")], [jax.random.normal(k[3], (11, 8)), mlp_params(k[4], 2)],
                    jnp.array([3, 0, 9], jnp.int32), side=jnp.array([0.5, 1.5, 1.0]))
    raise KeyError(name)


CASES = ("scanned", "blocks", "hetero_int_input", "side")


def loss_of(out):
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) * 0.37)
    return jnp.sum(jnp.tanh(out) * w)


def _argnums(x):
    return (0, 1) if jnp.issubdtype(x.dtype, jnp.floating) else 0


@functools.lru_cache(maxsize=None)
def plain_grads(name):
    """Loss and gradients of plain autodiff over the unreconstructed model."""
    case = _case(name)
    return jax.jit(jax.value_and_grad(lambda p, x: loss_of(case.plain(p, x)), argnums=_argnums(case.x),
                                      allow_int=True))(case.params, case.x)


@pytest.mark.parametrize("case_name", CASES + ("int_input_side",))
@pytest.mark.parametrize("storage", list(STORAGES))
def test_gradients_equal_plain_grad(storage, case_name):
    case = _case(case_name)
    stack = eae_jax.reconstruct(case.blocks, storage=STORAGES[storage])
    got = jax.jit(jax.value_and_grad(lambda p, x: loss_of(stack(p, x, side=case.side)), argnums=_argnums(case.x),
                                     allow_int=True))(case.params, case.x)
    want = plain_grads(case_name)
    assert rel_err(got[0], want[0]) <= 1e-6
    assert_grads_close(got[1], want[1], rtol=1e-5, atol=1e-6)


#: Which storage serves each segment of each case (`Reconstructed.storages`).
SERVED = {
    "device": {"scanned": ["OnDevice"], "blocks": ["OnDevice"] * 3, "hetero_int_input": ["OnDevice"] * 4,
               "side": ["OnDevice"]},
    "grad_slots": {"scanned": ["GradSlots"], "blocks": ["OnDevice"] * 3,
                   "hetero_int_input": ["OnDevice", "GradSlots", "OnDevice", "OnDevice"], "side": ["GradSlots"]},
    "policy": {"scanned": ["Policy"], "blocks": ["Policy"] * 3, "hetero_int_input": ["Policy"] * 4,
               "side": ["Policy"]},
    "host": {"scanned": ["Host"], "blocks": ["Host"] * 3, "hetero_int_input": ["Host"] * 4, "side": ["Host"]},
    "host_unrolled": {"scanned": ["HostUnrolled"], "blocks": ["Host"] * 3,
                      "hetero_int_input": ["Host", "HostUnrolled", "Host", "Host"], "side": ["HostUnrolled"]},
}


@pytest.mark.parametrize("storage", list(STORAGES))
def test_bind_picks_the_storage_serving_each_segment(storage):
    for name in CASES:
        case = _case(name)
        stack = eae_jax.reconstruct(case.blocks, storage=STORAGES[storage])
        served = [type(s).__name__ for s in stack.storages(case.params, case.x, side=case.side)]
        assert served == SERVED[storage][name], name


@pytest.mark.parametrize("depth, slots, host", [(0, "OnDevice", "Host"), (1, "GradSlots", "HostUnrolled")])
def test_a_run_of_depth_zero_is_served_by_the_plain_scan(depth, slots, host):
    params, x = mlp_params(jax.random.key(0), depth), jnp.ones((3, 8))
    for storage, served in ((GradSlots(), slots), (HostUnrolled(), host)):
        (store,) = eae_jax.reconstruct(mlp, storage=storage).storages(params, x)
        assert type(store).__name__ == served


@pytest.mark.parametrize("elems, x_dtype, stored, served", [
    (24, jnp.float32, None, "GradSlots"), (23, jnp.float32, None, "OnDevice"),
    (12, jnp.bfloat16, None, "GradSlots"), (11, jnp.bfloat16, None, "OnDevice"),
    (12, jnp.float32, "bfloat16", "GradSlots"), (11, jnp.float32, "bfloat16", "OnDevice")])
def test_grad_slots_serve_a_run_whose_float_params_hold_one_boundary(elems, x_dtype, stored, served):
    # The boundary is 3 x 8 in the storage's dtype, else x's: 96 bytes in float32, 48 in
    # bfloat16; the float32 params hold 4 bytes an element. Int and key leaves hold no
    # gradient bytes. A run it cannot serve is stored on the device in the same dtype.
    params = {"s": jnp.ones((2, elems)), "rng": jax.random.split(jax.random.key(0), 2),
              "n": jnp.zeros((2, 100), jnp.int32)}
    stack = eae_jax.reconstruct(lambda p, h: h * jnp.mean(p["s"]).astype(h.dtype), storage=GradSlots(stored))
    (store,) = stack.storages(params, jnp.ones((3, 8), x_dtype))
    assert type(store).__name__ == served
    assert store.dtype == (None if stored is None else np.dtype(stored))


def test_grad_slots_used_unbound_say_so():
    message = "GradSlots storage used before bind(layout) chose its slots (the stack binds it)"
    for use in (lambda s: s.forward(None, None, None, None), lambda s: s.backward(*[None] * 7)):
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
            use(GradSlots())


def test_grad_slots_fall_back_to_on_device_in_their_dtype():
    """Unscanned blocks, a run of depth 0 and int token ids: `OnDevice` with the same boundary dtype."""
    case = _case("hetero_int_input")
    served = eae_jax.reconstruct(case.blocks, storage=GradSlots("bfloat16")).storages(case.params, case.x)
    assert [(type(s).__name__, s.dtype) for s in served] == [
        ("OnDevice", np.dtype("bfloat16")), ("GradSlots", np.dtype("bfloat16")),
        ("OnDevice", np.dtype("bfloat16")), ("OnDevice", np.dtype("bfloat16"))]
    (empty,) = eae_jax.reconstruct(mlp, storage=GradSlots("bfloat16")).storages(mlp_params(jax.random.key(0), 0),
                                                                               jnp.ones((3, 8)))
    assert (type(empty).__name__, empty.dtype) == ("OnDevice", np.dtype("bfloat16"))


# ----------------------------------------------------------------------------- passes
PASSES = (P.int8_fake_quant(), P.clip_by_norm(0.05))


def reference_with_passes(case, passes, key, step=0):
    """Per-block VJP chain with ``passes`` applied at every float boundary
    in train step ``step``: ``(param grads per block, pass state per
    boundary, norms in, norms out)``."""
    flat = case.flat(case.params)
    hs = [case.x]
    for fn, p in flat:
        hs.append(fn(p, hs[-1]))
    num = len(hs)
    keys = jax.random.split(key, num)
    states, n_in, n_out = [None] * num, np.zeros(num), np.zeros(num)

    def at(i, g):
        state = passes.init(jax.ShapeDtypeStruct(g.shape, g.dtype), keys[i])
        out, states[i] = passes.update(g, state, P.PassContext(jnp.int32(i), jnp.int32(i), jnp.int32(step), num))
        n_in[i], n_out[i] = np.linalg.norm(np.asarray(g, np.float64)), np.linalg.norm(np.asarray(out, np.float64))
        return out

    g = at(num - 1, jax.grad(loss_of)(hs[-1]))
    grads = [None] * len(flat)
    for i in reversed(range(len(flat))):
        fn, p = flat[i]
        if jnp.issubdtype(hs[i].dtype, jnp.floating):
            _, pullback = jax.vjp(fn, p, hs[i])
            grads[i], g = pullback(g)
            g = at(i, g)
        else:
            _, pullback = jax.vjp(lambda pp: fn(pp, hs[i]), p)
            (grads[i],) = pullback(g)
    return grads, states, n_in, n_out


@pytest.mark.parametrize("storage", list(STORAGES))
def test_pass_state_and_stats_equal_a_per_block_reference(storage):
    case = _case("hetero_int_input")
    stack = eae_jax.reconstruct(case.blocks, storage=STORAGES[storage], passes=list(PASSES))
    carry = stack.init(case.params, case.x, jax.random.key(5))

    @jax.jit
    def step(p, c):
        gp, gc = jax.grad(lambda p, c: loss_of(stack(p, case.x, c)), argnums=(0, 1), allow_int=True)(p, c)
        c, stats = stack.update(c, gc)
        return gp, stack.state(c), stats

    gp, state, stats = step(case.params, carry)
    grads, states, n_in, n_out = reference_with_passes(case, P.chain(*PASSES), jax.random.key(5))
    # the stack's gradients and states per block: the scanned run's are stacked
    stack_grads = [gp[0], _rows(gp[1], 0), _rows(gp[1], 1), gp[2], gp[3]]
    assert_grads_close(stack_grads, grads, rtol=2e-5, atol=1e-7)
    seg = state["segments"]
    assert seg[0] is None and states[0] is None  # int token ids carry no adjoint
    chex.assert_trees_all_close([_rows(seg[1], 0), _rows(seg[1], 1), seg[2], seg[3], state["top"]], states[1:],
                                rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(stats["adjoint_norm"]), n_in, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(stats["adjoint_norm_after_passes"]), n_out, rtol=2e-5)
    assert float(stats["calls"]) == 1.0


def where_it_runs():
    """A pass that keeps the adjoint and records the `PassContext` it was
    given: ``int32[boundary, block, step, num_boundaries]``."""
    def update(g, state, ctx):
        seen = [ctx.boundary, ctx.block, ctx.step, ctx.num_boundaries]
        return g, jnp.stack([jnp.asarray(v, jnp.int32) for v in seen])

    return P.AdjointTransformation(lambda spec, key: jnp.full((4,), -1, jnp.int32), update, name="where")


@pytest.mark.parametrize("storage", [*STORAGES, "runs"])
def test_a_pass_sees_its_boundary_block_step_and_count_in_a_passes_scope(storage):
    """A custom pass reads the whole `PassContext` (block is the boundary's
    index too; no built-in pass reads it) at every float boundary, in the
    carry's step (1: after one update); the chain's ops sit in the ``passes``
    scope the ``--profile`` stage table reads, and the statistics are the
    norms before and after the chain, in float64 numpy."""
    case = _case("hetero_int_input")
    passes = [where_it_runs(), P.decay(0.25)]
    if storage == "runs":  # the scanned segment as two runs: the second's blocks start at its offset
        storage = [OnDevice(), Runs(((1, Policy("dots")), (1, GradSlots()))), OnDevice(), OnDevice()]
    else:
        storage = STORAGES[storage]
    stack = eae_jax.reconstruct(case.blocks, storage=storage, passes=passes)

    def step(p, c):
        gc = jax.grad(lambda c: loss_of(stack(p, case.x, c)))(c)
        c, stats = stack.update(c, gc)
        return c, stack.state(c), stats

    step = jax.jit(step)
    carry, _, _ = step(case.params, stack.init(case.params, case.x))
    _, state, stats = step(case.params, carry)
    _, want, n_in, n_out = reference_with_passes(case, P.chain(*passes), jax.random.key(0), step=1)
    seg = state["segments"]
    assert seg[0] is None and want[0] is None
    got = [_rows(seg[1], 0), _rows(seg[1], 1), seg[2], seg[3], state["top"]]
    for i, (g, w) in enumerate(zip(got, want[1:]), start=1):
        np.testing.assert_array_equal(np.asarray(g[0]), [i, i, 1, 6])
        np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(w[0]))
    np.testing.assert_allclose(np.asarray(stats["adjoint_norm"]), n_in, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(stats["adjoint_norm_after_passes"]), n_out, rtol=2e-6)
    np.testing.assert_allclose(n_out, 0.75 * n_in, rtol=1e-6)
    traced = step.lower(case.params, carry).as_text(debug_info=True)
    stages = {stage_of(name) for name in re.findall(r'loc\("([^"]*)"', traced)}
    assert "passes" in stages, sorted(stages)


def test_without_stats_the_passes_run_and_the_norms_stay_zero():
    """``stats=False``: the pass chain still acts (the per-block reference's
    gradients), and the carry's statistics are the zeros `init` made."""
    case = _case("hetero_int_input")
    stack = eae_jax.reconstruct(case.blocks, passes=P.decay(0.25), stats=False)
    carry = stack.init(case.params, case.x)
    gp, gc = jax.jit(jax.grad(lambda p, c: loss_of(stack(p, case.x, c)), argnums=(0, 1), allow_int=True))(
        case.params, carry)
    _, stats = stack.update(carry, gc)
    want, _, _, _ = reference_with_passes(case, P.decay(0.25), jax.random.key(0))
    assert_grads_close([gp[0], _rows(gp[1], 0), _rows(gp[1], 1), gp[2], gp[3]], want, rtol=2e-5, atol=1e-6)
    for name in ("adjoint_norm", "adjoint_norm_after_passes"):
        np.testing.assert_array_equal(np.asarray(stats[name]), np.zeros(6, np.float32))


@pytest.mark.parametrize("storage", list(STORAGES))
def test_a_pass_at_one_boundary_acts_there_only(storage):
    """Zeroing the adjoint at boundary 2 (the input of block 2 of 3) leaves block 2 plain
    `jax.grad`'s gradients and gives blocks 0 and 1 and the input none: the scan hands each
    block its own boundary index."""
    case = _case("scanned")
    stack = eae_jax.reconstruct(case.blocks, storage=STORAGES[storage], passes=P.at_layers(P.decay(1.0), [2]))
    carry = stack.init(case.params, case.x)
    gp, gx = jax.jit(jax.grad(lambda p, x: loss_of(stack(p, x, carry)), argnums=(0, 1), allow_int=True))(
        case.params, case.x)
    _, (want, _) = plain_grads("scanned")
    for name in ("w1", "w2", "s"):
        np.testing.assert_allclose(np.asarray(gp[name][2]), np.asarray(want[name][2]), rtol=2e-5, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(gp[name][:2]), 0.0)
    np.testing.assert_array_equal(np.asarray(gx), 0.0)


# ----------------------------------------------------------------------------- bf16 boundaries
def rounded_boundary_grads(case):
    """Gradients of recomputing each block from its input rounded to bf16
    (the forward itself unrounded)."""
    flat = case.flat(case.params)
    hs = [case.x]
    for fn, p in flat:
        hs.append(fn(p, hs[-1]))
    g = jax.grad(loss_of)(hs[-1])
    grads = [None] * len(flat)
    for i in reversed(range(len(flat))):
        fn, p = flat[i]
        _, pullback = jax.vjp(fn, p, hs[i].astype(jnp.bfloat16).astype(hs[i].dtype))
        grads[i], g = pullback(g)
    return grads, g


@pytest.mark.parametrize("storage", [OnDevice, GradSlots, Host, HostUnrolled])
def test_bf16_boundaries_recompute_each_block_from_its_rounded_input(storage):
    case = _case("scanned")
    stack = eae_jax.reconstruct(case.blocks, storage=storage("bfloat16"))
    y = jax.jit(stack)(case.params, case.x)
    # the forward is unrounded (bf16 would be off by ~1e-3)
    np.testing.assert_allclose(np.asarray(y), np.asarray(case.plain(case.params, case.x)), rtol=1e-6, atol=1e-6)
    gp, gx = jax.jit(jax.grad(lambda p, x: loss_of(stack(p, x)), argnums=(0, 1), allow_int=True))(case.params, case.x)
    want, want_x = rounded_boundary_grads(case)
    assert_grads_close([_rows(gp, i) for i in range(3)] + [gx], want + [want_x], rtol=1e-5, atol=1e-6)
    # and the rounding is real: plain autodiff differs
    assert rel_err(gp["w1"], plain_grads("scanned")[1][0]["w1"]) > 1e-4


@pytest.mark.parametrize("storage", [OnDevice, GradSlots, Host, HostUnrolled])
def test_a_boundary_dtype_is_read_when_the_storage_is_made(storage):
    """Any spelling of a dtype makes the same storage (equal, same hash: one jit cache entry);
    an unknown name fails where the storage is made, not inside a traced backward."""
    made = storage("bfloat16")
    assert made == storage(jnp.bfloat16) and hash(made) == hash(storage(np.dtype(jnp.bfloat16)))
    assert isinstance(made.dtype, np.dtype) and made.dtype == jnp.dtype(jnp.bfloat16)
    with pytest.raises(TypeError, match="float7"):
        storage("float7")


def test_a_boundary_is_cast_only_when_floating_and_a_dtype_is_given():
    """No dtype keeps a bf16 boundary bf16 (``astype(None)`` would widen it to float32);
    int token ids stay ints whatever the storage's dtype."""
    from eae_jax.reconstruct.storage import cast_boundary

    half = jnp.array([1.5, -2.25], jnp.bfloat16)
    assert cast_boundary(half, None).dtype == jnp.bfloat16 and OnDevice().put(half).dtype == jnp.bfloat16
    tokens = jnp.array([3, 0, 9], jnp.int32)
    for kept in (cast_boundary(tokens, jnp.dtype(jnp.bfloat16)), OnDevice("bfloat16").put(tokens)):
        assert kept.dtype == jnp.int32 and np.array_equal(np.asarray(kept), [3, 0, 9])
    x = jnp.array([1.0, 1.0 + 2.0 ** -10], jnp.float32)
    np.testing.assert_array_equal(np.asarray(cast_boundary(x, jnp.dtype(jnp.bfloat16)), np.float32), [1.0, 1.0])


# ----------------------------------------------------------------------------- per segment
def test_one_storage_per_segment():
    case = _case("hetero_int_input")
    storages = [Host(), GradSlots(), Policy("dots_all"), OnDevice()]
    stack = eae_jax.reconstruct(case.blocks, storage=storages)
    assert [s.kind for s in stack.storages(case.params, case.x)] == ["host", "grad_slots", "policy", "device"]
    got = jax.jit(jax.value_and_grad(lambda p: loss_of(stack(p, case.x)), allow_int=True))(case.params)
    want = plain_grads("hetero_int_input")
    assert rel_err(got[0], want[0]) <= 1e-6
    assert_grads_close(got[1], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, served", [
    ({}, GradSlots(None)),
    ({"boundaries_in_grads": False}, OnDevice(None)),
    ({"boundary_dtype": "bf16"}, GradSlots(jnp.bfloat16)),
    ({"boundary_dtype": "bf16", "boundaries_in_grads": False}, OnDevice(jnp.bfloat16)),
    ({"offload": True, "boundary_dtype": "bf16"}, Host(jnp.bfloat16)),
    ({"offload": "scan"}, Host(None)),
    ({"offload": "unrolled"}, HostUnrolled(None)),
    ({"policy": "boundaries"}, GradSlots(None)),
    ({"policy": "dots", "offload": True, "boundary_dtype": "bf16"}, Policy("dots")),
])
def test_keywords_choose_one_storage_for_all_segments(kwargs, served):
    stack = eae_jax.reconstruct(mlp, **kwargs)
    (store,) = stack.storage
    assert type(store) is type(served) and getattr(store, "dtype", None) == getattr(served, "dtype", None)
    assert getattr(store, "policy", None) is getattr(served, "policy", None)


def test_storage_arguments_are_checked():
    with pytest.raises(ValueError, match="storage= or boundary_dtype, offload, not both"):
        eae_jax.reconstruct(mlp, storage=OnDevice(), offload=True, boundary_dtype="bf16")
    with pytest.raises(ValueError, match="storage= or boundaries_in_grads"):
        eae_jax.reconstruct(mlp, storage=OnDevice(), boundaries_in_grads=False)
    with pytest.raises(ValueError, match="2 storages given for 4 segments"):
        eae_jax.reconstruct(_case("hetero_int_input").blocks, storage=[OnDevice(), Host()])
    with pytest.raises(TypeError, match="storage 1 is 'host'"):
        eae_jax.reconstruct([mlp, mlp], storage=[OnDevice(), "host"])
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("sometimes")
    assert type(Policy("boundaries").bind(None)) is OnDevice


# ----------------------------------------------------------------------------- policy residuals
def test_policy_supplies_the_params_again_instead_of_keeping_them():
    case = _case("scanned")
    one_block = jax.eval_shape(lambda p: _rows(p, 0), case.params)
    layout = SegmentLayout(Segment(mlp, "mlp", True), 3, one_block, jax.eval_shape(lambda x: x, case.x), None, 0)
    split = split_vjp(layout, jax.checkpoint_policies.everything_saveable)
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(case.params)]
    given = {names[j] for src, j in split.sources if src == "param"}
    assert {"['w1']", "['w2']"} <= given  # both matmuls' backward reads its weight


def test_policy_names_resolve_and_bad_policies_are_named_in_full():
    cp = jax.checkpoint_policies
    assert resolve_policy(None) is None and resolve_policy("boundaries") is None
    assert resolve_policy("dots") is cp.dots_with_no_batch_dims_saveable
    assert resolve_policy("dots_all") is cp.dots_saveable and resolve_policy("everything") is cp.everything_saveable
    assert resolve_policy(cp.nothing_saveable) is cp.nothing_saveable
    with pytest.raises(ValueError) as err:
        Policy("sometimes")
    assert str(err.value) == ("unknown policy 'sometimes'; expected one of "
                              "['boundaries', 'dots', 'dots_all', 'everything'] or a callable")
    with pytest.raises(ValueError) as err:
        Policy(3)
    assert str(err.value) == "policy must be None, a name or a jax.checkpoint_policies callable, got 3"
    unbound = Policy("dots")
    for use in (lambda: unbound.save(None, None, None, None), lambda: unbound.restore(None, None, None, None, None)):
        with pytest.raises(RuntimeError) as err:
            use()
        assert str(err.value) == "Policy storage used before bind(layout) traced its block (the stack binds it)"


def _affine_side(p, x, s):
    return jnp.tanh(x @ p["w"]) * s + p["b"]


def _embed_side(table, tokens, s):
    return table[tokens] * s


def _stateful(w, x):
    return jnp.sin(x) * w, {"n": w + 1.0, "w": w}


_k = jax.random.split(jax.random.key(21), 5)
#: Blocks whose residuals can be read off: under ``nothing_saveable`` the VJP keeps only the
#: remat's inputs its backward reads (``b`` is added: not read); ``dots_saveable`` adds the
#: matmul's output. The int tokens and the stateful block's ``x`` are inputs, so they are kept;
#: the stateful block's new ``w`` passes its param through but is state, not a residual.
SPLIT_CASES = {
    "param_and_side_through": (_affine_side, {"b": jax.random.normal(_k[0], (2,)), "w": jax.random.normal(_k[1], (2, 2))},
                               jax.random.normal(_k[2], (3, 2)), jnp.array([[0.5], [1.5], [-1.0]]), False,
                               {"nothing": [("kept", 0), ("param", 1), ("side", 0)],
                                "dots": [("kept", 0), ("kept", 1), ("param", 1), ("side", 0)]}),
    "int_input_kept": (_embed_side, jax.random.normal(_k[3], (5, 2)), jnp.array([4, 0, 4], jnp.int32),
                       jnp.array([[0.5], [1.5], [-1.0]]), False,
                       {"nothing": [("kept", 0), ("side", 0)], "dots": [("kept", 0), ("side", 0)]}),
    "state_passes_a_param": (_stateful, jax.random.normal(_k[4], (2,)), jax.random.normal(_k[2], (3, 2)), None, True,
                             {"nothing": [("kept", 0), ("param", 0)], "dots": [("kept", 0), ("param", 0)]}),
}


@pytest.mark.parametrize("policy", ["nothing", "dots"])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_vjp_passes_params_and_side_through_and_restores_jax_vjp(case, policy):
    fn, params, x, side, stateful, want_sources = SPLIT_CASES[case]
    spec = functools.partial(jax.tree_util.tree_map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype))
    layout = SegmentLayout(Segment(fn, case, False, stateful), 1, spec(params), spec(x), spec(side), 0)
    bound = Policy(getattr(jax.checkpoint_policies, policy + "_saveable")).bind(layout)
    split = bound.split
    assert sorted(split.sources) == want_sources[policy]
    assert split.float_in == (x.dtype == jnp.float32)
    block = (lambda p, h: fn(p, h)) if side is None else (lambda p, h: fn(p, h, side))
    out, kept = bound.save(layout, params, x, side)
    assert len(kept) == sum(src == "kept" for src, _ in split.sources)
    chex.assert_trees_all_close(out, block(params, x), rtol=1e-6, atol=0)
    if stateful:
        assert split.state == jax.tree_util.tree_structure({"n": 0, "w": 0})
        y_of = lambda p, h: block(p, h)[0]  # noqa: E731
    else:
        assert split.state is None
        y_of = block
    g = jnp.cos(jnp.arange(6.0).reshape(3, 2))
    got = bound.restore(layout, params, kept, g, side)
    if split.float_in:
        want = jax.vjp(y_of, params, x)[1](g)
    else:
        want = (jax.vjp(lambda p: y_of(p, x), params)[1](g)[0], None)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)


class _KeepAll(Policy):
    """`Policy` keeping every residual, the params and side input included."""

    def bind(self, layout):
        split = split_vjp(layout, self.policy)
        return dataclasses.replace(self, split=split._replace(
            sources=tuple(("kept", k) for k in range(len(split.sources)))))


def test_policy_keeps_no_copy_of_the_side_input_per_block():
    # A residual that is the side input was stacked once per block by the
    # scan; a stacked copy of the params too where JAX does not forward a
    # scan's unchanged inputs.
    depth, side = 6, jnp.linspace(0.0, 1.0, 256 * 8).reshape(256, 8)
    params = mlp_params(jax.random.key(0), depth)
    x = jnp.ones((256, 8))

    def temp_bytes(storage):
        stack = eae_jax.reconstruct(lambda p, h, s: mlp(p, h) * s, storage=storage)
        f = jax.jit(jax.grad(lambda p, x, s: jnp.sum(stack(p, x, side=s)), allow_int=True))
        return f.lower(params, x, side).compile().memory_analysis().temp_size_in_bytes

    saved = temp_bytes(_KeepAll("dots")) - temp_bytes(Policy("dots"))
    assert saved >= (depth - 1) * side.size * 4, saved / (side.size * 4)


def test_a_custom_storage_is_two_methods():
    class Inputs(Storage):
        def save(self, layout, params, x, side):
            return layout.call(params, x, side), x

        def restore(self, layout, params, residual, g, side):
            return layout.vjp(params, residual, g, side)

    case = _case("hetero_int_input")
    stack = eae_jax.reconstruct(case.blocks, storage=Inputs())
    got = jax.jit(jax.value_and_grad(lambda p: loss_of(stack(p, case.x)), allow_int=True))(case.params)
    assert_grads_close(got[1], plain_grads("hetero_int_input")[1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- runs
RUNS = {
    "slots-dots-host": ((1, GradSlots()), (1, Policy("dots")), (1, Host())),
    "device-slots": ((2, OnDevice()), (1, GradSlots())),
    "slots-everything-slots": ((1, GradSlots()), (1, Policy("everything")), (1, GradSlots())),
    "one-run": ((3, Policy("dots_all")),),
}


@pytest.mark.parametrize("case_name", ["scanned", "side"])
@pytest.mark.parametrize("runs", list(RUNS))
def test_runs_gradients_equal_plain_grad(runs, case_name):
    case = _case(case_name)
    stack = eae_jax.reconstruct(case.blocks, storage=Runs(RUNS[runs]))
    got = jax.jit(jax.value_and_grad(lambda p, x: loss_of(stack(p, x, side=case.side)), argnums=(0, 1),
                                     allow_int=True))(case.params, case.x)
    want = plain_grads(case_name)
    assert rel_err(got[0], want[0]) <= 1e-6
    assert_grads_close(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_runs_carry_the_pass_state_of_each_block():
    case = _case("hetero_int_input")
    storages = [OnDevice(), Runs(((1, Policy("dots")), (1, GradSlots()))), OnDevice(), OnDevice()]
    stack = eae_jax.reconstruct(case.blocks, storage=storages, passes=list(PASSES))
    assert [s.kind for s in stack.storages(case.params, case.x)[1].bound] == ["policy", "grad_slots"]

    @jax.jit
    def step(p, c):
        gp, gc = jax.grad(lambda p, c: loss_of(stack(p, case.x, c)), argnums=(0, 1), allow_int=True)(p, c)
        return gp, stack.update(c, gc)[1]

    gp, stats = step(case.params, stack.init(case.params, case.x, jax.random.key(5)))
    grads, states, n_in, n_out = reference_with_passes(case, P.chain(*PASSES), jax.random.key(5))
    assert_grads_close([gp[0], _rows(gp[1], 0), _rows(gp[1], 1), gp[2], gp[3]], grads, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(stats["adjoint_norm"]), n_in, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(stats["adjoint_norm_after_passes"]), n_out, rtol=2e-5)


def test_runs_write_gradients_in_place():
    # Separate per-run gradient arrays would be concatenated at the end: a
    # second copy of a run's gradients at the step's last moment.
    depth, x = 8, jnp.ones((64, 8))
    params = {"w1": jnp.full((depth, 8, 96), 0.01), "w2": jnp.full((depth, 96, 8), 0.01)}

    def peak(storage):
        stack = eae_jax.reconstruct(lambda p, h: h + jnp.tanh(h @ p["w1"]) @ p["w2"], storage=storage)
        ma = jax.jit(jax.grad(lambda p: jnp.sum(stack(p, x)))).lower(params).compile().memory_analysis()
        return ma.temp_size_in_bytes + ma.output_size_in_bytes

    one_block_grads = 2 * 8 * 96 * 4
    assert abs(peak(Runs(((4, OnDevice()), (4, OnDevice())))) - peak(OnDevice())) < one_block_grads / 4


def test_runs_arguments_are_checked():
    case = _case("scanned")
    with pytest.raises(ValueError, match="the runs hold 2 blocks but segment .* has 3"):
        eae_jax.reconstruct(case.blocks, storage=Runs(((2, OnDevice()),))).storages(case.params, case.x)
    with pytest.raises(ValueError, match="cannot be HostUnrolled"):
        Runs(((3, HostUnrolled()),))
    with pytest.raises(ValueError, match="block counts must be ints >= 0"):
        Runs(((-1, OnDevice()),))
    with pytest.raises(TypeError, match="not an eae_jax.reconstruct storage"):
        Runs(((3, "device"),))
    with pytest.raises(ValueError, match="is a single block, not a Scan"):
        eae_jax.reconstruct([mlp], storage=Runs(((1, OnDevice()),))).storages([_rows(case.params, 0)], case.x)
    with pytest.raises(ValueError, match="same dtype"):
        eae_jax.reconstruct(case.blocks, storage=Runs(((2, GradSlots()), (1, GradSlots("bfloat16"))))).storages(
            case.params, case.x)

    class OwnLoop(OnDevice):
        def forward(self, layout, params, x, side):
            return super().forward(layout, params, x, side)

    with pytest.raises(ValueError, match="runs its own loop"):
        eae_jax.reconstruct(case.blocks, storage=Runs(((3, OwnLoop()),))).storages(case.params, case.x)
    # a run of no blocks is dropped
    assert [n for n, _ in Runs(((0, Host()), (3, OnDevice()))).runs] == [3]


def test_runs_of_bfloat16_params_keep_their_gradients_in_bfloat16_slots():
    # The slot run's gradients of w are written into 2-byte slots (a float32
    # copy of them would be twice a slot's width), b's into a bfloat16 buffer.
    k = jax.random.split(jax.random.key(2), 3)
    w = {"w": (0.3 * jax.random.normal(k[0], (3, 8, 8))).astype(jnp.bfloat16),
         "b": (0.1 * jax.random.normal(k[1], (3, 8))).astype(jnp.bfloat16)}
    x = jax.random.normal(k[2], (2, 8)).astype(jnp.bfloat16)
    block = lambda p, h: jnp.tanh(h @ p["w"] + p["b"])  # noqa: E731
    stack = eae_jax.reconstruct(block, storage=Runs(((2, GradSlots()), (1, OnDevice()))))
    assert [s.kind for s in stack.storages(w, x)[0].bound] == ["grad_slots", "device"]
    got = jax.jit(jax.grad(lambda w: jnp.sum(stack(w, x).astype(jnp.float32))))(w)
    plain = lambda w: jax.lax.scan(lambda h, wi: (block(wi, h), None), x, w)[0]  # noqa: E731
    want = jax.jit(jax.grad(lambda w: jnp.sum(plain(w).astype(jnp.float32))))(w)
    assert got["w"].dtype == got["b"].dtype == jnp.bfloat16
    assert_grads_close(got, want, rtol=2e-2, atol=2e-2)


def test_differentiating_the_cotangent_through_a_slot_run_is_refused_by_name():
    # As test_reconstruct.py's test for GradSlots alone: the gradients a slot
    # run writes as raw bytes are guarded, naming the storage and the fix.
    params, x = 0.5 * jax.random.normal(jax.random.key(0), (3, 4, 4)), jnp.ones((2, 4))
    stack = eae_jax.reconstruct(lambda w, h: jnp.tanh(h @ w), storage=Runs(((1, OnDevice()), (2, GradSlots()))))
    inner = lambda c: jax.grad(lambda p: c * jnp.sum(jnp.sin(stack(p, x))))(params)  # noqa: E731
    message = (r"with grad_slots storage: boundaries stored as raw bytes in gradient buffers carry no "
               r"derivative\. Build the stack with boundaries_in_grads=False")
    with pytest.raises(ValueError, match=message):
        jax.grad(lambda c: jnp.sum(inner(c) ** 2))(2.0)


def _run_layout(scanned=True, depth=3):
    """The layout of a segment of ``mlp`` blocks whose first boundary is x4."""
    one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mlp_params(jax.random.key(0)))
    return SegmentLayout(Segment(mlp, "body", scanned), depth, one, jax.ShapeDtypeStruct((3, 8), jnp.float32), None, 4)


class _OwnLoop(OnDevice):
    def forward(self, layout, params, x, side):
        return super().forward(layout, params, x, side)


@pytest.mark.parametrize("runs, exc, msg", [
    (((True, OnDevice()),), ValueError, "Runs: block counts must be ints >= 0, got True"),
    (((1.0, OnDevice()),), ValueError, "Runs: block counts must be ints >= 0, got 1.0"),
    (((-1, OnDevice()),), ValueError, "Runs: block counts must be ints >= 0, got -1"),
    (((3, "device"),), TypeError, "Runs: 'device' is not an eae_jax.reconstruct storage"),
    (((3, HostUnrolled()),), ValueError, "Runs: a run cannot be HostUnrolled (use Host for host memory)"),
    (((3, Runs()),), ValueError, "Runs: a run cannot be Runs (use Host for host memory)"),
], ids=["bool", "float", "negative", "not-a-storage", "host-unrolled", "nested"])
def test_runs_refuse_a_bad_run_in_full(runs, exc, msg):
    with pytest.raises(exc) as err:
        Runs(runs)
    assert str(err.value) == msg


@pytest.mark.parametrize("runs, msg", [
    (((2, OnDevice()),), "Runs: the runs hold 2 blocks but segment 'body' has 3"),
    (((2, OnDevice()), (2, OnDevice())), "Runs: the runs hold 4 blocks but segment 'body' has 3"),
    (((2, GradSlots()), (1, GradSlots("bfloat16"))),
     "Runs: gradient-slot runs of one segment must store their boundaries in the same dtype"),
    (((3, _OwnLoop()),), "Runs: _OwnLoop runs its own loop over the blocks and cannot be one run of several"),
], ids=["fewer", "more", "slot-dtypes", "own-loop"])
def test_runs_bind_refusals_are_named_in_full(runs, msg):
    with pytest.raises(ValueError) as err:
        Runs(runs).bind(_run_layout())
    assert str(err.value) == msg


def test_runs_bind_refuses_a_single_block_and_unbound_runs_say_so():
    with pytest.raises(ValueError) as err:
        Runs(((1, OnDevice()),)).bind(_run_layout(scanned=False, depth=1))
    assert str(err.value) == "Runs: segment 'body' is a single block, not a Scan"
    runs, lay = Runs(((3, OnDevice()),)), _run_layout()
    for call in (lambda: runs.forward(lay, None, None, None), lambda: runs.backward(lay, None, None, None, None,
                                                                                     None, None)):
        with pytest.raises(RuntimeError) as err:
            call()
        assert str(err.value) == "Runs storage used before bind(layout) (the stack binds it)"
    for call in (lambda: runs.save(lay, None, None, None), lambda: runs.restore(lay, None, None, None, None)):
        with pytest.raises(TypeError) as err:
            call()
        assert str(err.value) == "Runs serves scanned segments only"
    assert runs.kind == "runs"


def test_a_custom_run_sees_its_own_blocks_in_save_and_restore():
    # A Storage subclass with only save/restore, as the Runs docstring
    # allows, is given its run's layout: its depth and first boundary.
    seen = []

    class Inputs(Storage):
        def save(self, layout, params, x, side):
            seen.append(("save", layout.depth, layout.first))
            return layout.call(params, x, side), x

        def restore(self, layout, params, residual, g, side):
            seen.append(("restore", layout.depth, layout.first))
            return layout.vjp(params, residual, g, side)

    params, x = 0.5 * jax.random.normal(jax.random.key(0), (5, 4, 4)), jnp.ones((2, 4))
    block = lambda w, h: jnp.tanh(h @ w)  # noqa: E731
    stack = eae_jax.reconstruct([block, eae_jax.Scan(block)], storage=[OnDevice(), Runs(
        ((1, Inputs()), (1, OnDevice()), (2, Inputs())))])
    got = jax.grad(lambda p: jnp.sum(stack(p, x)))([params[0], params[1:]])
    assert sorted(set(seen)) == [("restore", 1, 1), ("restore", 2, 3), ("save", 1, 1), ("save", 2, 3)]
    plain = lambda p: jnp.sum(jax.lax.scan(lambda h, w: (block(w, h), None), x, p)[0])  # noqa: E731
    want = jax.grad(plain)(params)
    chex.assert_trees_all_close(got, [want[0], want[1:]], rtol=1e-5, atol=1e-6)


def test_runs_bind_each_run_to_its_own_blocks():
    # Run r sees depth n_r and first boundary x(4 + blocks before it); the
    # slot plan is the one GradSlots makes for the segment.
    seen = []

    class Recording(OnDevice):
        def bind(self, layout):
            seen.append((layout.depth, layout.first, layout.segment.name))
            return self

    lay = _run_layout(depth=6)
    runs = Runs(((np.int64(1), Recording()), (0, Host()), (2, GradSlots()), (3, Recording())))
    bound = runs.bind(lay)
    assert [(n, type(n)) for n, _ in bound.runs] == [(1, int), (2, int), (3, int)]
    assert seen == [(1, 4, "body"), (3, 7, "body")]
    assert [s.kind for s in bound.bound] == ["device", "grad_slots", "device"]
    want = GradSlots().bind(lay._replace(depth=2, first=5)).plan
    assert want is not None and bound.slots == want == bound.bound[1].plan
# ----------------------------------------------------------------------------- blocks that update state
def counted_mlp(p, h):
    """`mlp` whose dropout key is ``fold_in(p['rng'], p['count'])`` (an ``nnx.Dropout``'s
    RNG stream): returns ``(y, new state)``, the count advanced and a running mean of ``h``."""
    keep = jax.random.bernoulli(jax.random.fold_in(p["rng"], p["count"]), 0.75, h.shape)
    y = h + jnp.where(keep, jnp.tanh(h @ p["w1"]) @ p["w2"], 0.0) * p["s"]
    return y, {"count": p["count"] + 1, "mean": 0.9 * p["mean"] + 0.1 * jnp.mean(h, axis=0)}


def counted_params(key, depth=None):
    p = mlp_params(key, depth)
    lead = () if depth is None else (depth,)
    return {"w1": p["w1"], "w2": p["w2"], "s": p["s"], "rng": p["rng"],
            "count": jnp.full(lead, 3, jnp.uint32), "mean": jnp.zeros(lead + (8,))}


def stateless_head(w, h):
    return h @ w, None


#: The mesh storage around the default one, its boundaries laid out on the batch axis: a
#: stateful block's new state passes through it untouched (only ``y`` takes ``x_spec``).
# Runs serve the scanned segment only: the others keep their boundaries on the device.
STATEFUL_STORAGES = {**STORAGES, "runs": [Runs(((1, GradSlots()), (1, Policy("dots")))), OnDevice(), OnDevice()],
                     "sharded": Sharded(GradSlots(), make_mesh("data=1"), None, x_spec=PartitionSpec("data"))}


@pytest.mark.parametrize("storage", list(STATEFUL_STORAGES))
def test_block_state_comes_out_of_the_forward_and_the_backward_sees_the_old(storage):
    k = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(k[0], (3, 8))
    blocks = [Scan(counted_mlp), counted_mlp, stateless_head]
    params = [counted_params(k[1], 2), counted_params(k[2]), 0.5 * jax.random.normal(k[3], (8, 5))]
    flat = [(counted_mlp, _rows(params[0], 0)), (counted_mlp, _rows(params[0], 1)), (counted_mlp, params[1]),
            (stateless_head, params[2])]

    def plain(ps, x):  # ordinary autodiff block by block, every block's state kept
        states = []
        for (fn, _), p in zip(flat, ps):
            x, state = fn(p, x)
            states.append(state)
        return loss_of(x), states

    (want_loss, want_states), want_grads = jax.jit(jax.value_and_grad(plain, has_aux=True, allow_int=True))(
        [p for _, p in flat], x)
    stack = eae_jax.reconstruct(blocks, storage=STATEFUL_STORAGES[storage], block_state=True)

    def loss(p, x):
        y, states = stack(p, x)
        return loss_of(y), states

    (got_loss, states), grads = jax.jit(jax.value_and_grad(loss, has_aux=True, allow_int=True))(params, x)
    assert rel_err(got_loss, want_loss) <= 1e-6
    assert states[2] is None  # the head's
    got_states = [_rows(states[0], 0), _rows(states[0], 1), states[1], None]
    got_grads = [_rows(grads[0], 0), _rows(grads[0], 1), grads[1], grads[2]]
    chex.assert_trees_all_close(got_states, want_states, rtol=1e-6, atol=1e-7)
    assert_grads_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)
    # the counts advanced by one: recomputing from the new count would have drawn other masks
    assert got_states[0]["count"].tolist() == 4


def test_block_state_is_not_differentiated_and_a_block_must_return_a_pair():
    stack = eae_jax.reconstruct(lambda w, x: (x * w, x * w), block_state=True)
    w, x = jnp.full((2, 3), 2.0), jnp.ones(3)
    # the loss reads the state too: its cotangent is dropped, y's goes through (dL/dw_i = 4 for y = 4x)
    g = jax.grad(lambda w: jnp.sum(stack(w, x)[0]) + jnp.sum(stack(w, x)[1]))(w)
    np.testing.assert_allclose(np.asarray(g), [[2.0] * 3, [2.0] * 3])
    with pytest.raises(TypeError, match=r"block 'scale' must return \(y, new_state\)"):
        eae_jax.reconstruct(Scan(lambda w, x: x * w, "scale"), block_state=True)(w, x)


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("scanned", [False, True])
def test_an_integer_to_integer_block_gets_zero_gradients_like_plain_autodiff(storage, scanned):
    # Tokens to tokens (a float and an int param), then an embedding and a float stack:
    # no adjoint reaches the first block, so its float param's gradient is zero (as
    # jax.grad of the plain composition has it) and its int param's is float0.
    def remap(p, t):
        return (t * p["mul"] + p["shift"].astype(jnp.int32)) % 7

    first = eae_jax.Scan(remap) if scanned else remap
    stack = eae_jax.reconstruct([first, lambda tab, t: tab[t], eae_jax.Scan(lambda w, h: jnp.tanh(h @ w))],
                                storage=STORAGES[storage])
    lead = (2,) if scanned else ()
    p0 = {"mul": jnp.full(lead, 3, jnp.int32), "shift": jnp.full(lead, 1.5)}
    params = [p0, jax.random.normal(jax.random.key(0), (7, 4)), 0.3 * jax.random.normal(jax.random.key(1), (2, 4, 4))]
    toks = jnp.arange(6).reshape(2, 3)

    def plain(ps):
        t = toks
        for i in range(2 if scanned else 1):
            t = remap(jax.tree_util.tree_map(lambda a: a[i], ps[0]) if scanned else ps[0], t)
        h = ps[1][t]
        for w in ps[2]:
            h = jnp.tanh(h @ w)
        return h.sum()

    got = jax.grad(lambda ps: stack(ps, toks).sum(), allow_int=True)(params)
    want = jax.grad(plain, allow_int=True)(params)
    assert got[0]["mul"].dtype == jax.dtypes.float0 and got[0]["mul"].shape == lead
    np.testing.assert_array_equal(got[0]["shift"], np.zeros(lead, np.float32))
    chex.assert_trees_all_close(got[1:], want[1:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stack(params, toks).sum(), plain(params), rtol=1e-6)
