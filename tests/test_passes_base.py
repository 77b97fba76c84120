"""`eae_jax.passes.base`: the pass protocol and its combinators (`stateless`,
`check_adjoint`, `apply_pass`, `as_pass`, `from_optax`, `chain`, `identity`,
`at_layers`, `every_n_steps`, `runs_at`) by direct, eager calls on tiny
arrays, against numbers written out or computed with plain numpy (the
combinators inside a stack: tests/test_passes.py).
"""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from eae_jax import passes as P
from eae_jax.buffers import aliased_leaves
from eae_jax.passes.base import apply_pass, check_adjoint, runs_at

G = np.array([1.0, -2.0, 0.5], np.float32)


def _ctx(boundary=0, num=4, step=0):
    return P.PassContext(jnp.int32(boundary), jnp.int32(boundary), jnp.int32(step), num)


def _spec(g):
    return jax.ShapeDtypeStruct(np.shape(g), np.asarray(g).dtype)


def _raises(exc, fn):
    with pytest.raises(exc) as err:
        fn()
    return str(err.value)


def _affine(scale, shift, name, seen=None):
    """A pass ``g -> g * scale + shift`` counting its calls in an int32 state;
    ``seen`` records what init and update are given."""
    seen = [] if seen is None else seen

    def init(spec, key):
        seen.append(("init", spec, key))
        return jnp.zeros((), jnp.int32)

    def update(g, count, ctx):
        seen.append(("update", count, ctx))
        return g * scale + shift, count + 1

    return P.AdjointTransformation(init, update, name)


def _key_bits(key):
    return np.asarray(jax.random.key_data(key))


# ----------------------------------------------------------------------------- runs_at
def test_runs_at_is_true_without_a_rule_and_a_bool_of_the_rule_given_host_ints():
    assert runs_at(P.identity(), 2, 4, 7) is True
    assert runs_at(types.SimpleNamespace(), 0, 1, 0) is True  # no runs_at attribute at all
    calls = []

    def rule(*args):
        calls.append(args)
        return len(calls)  # truthy int, made a bool

    p = P.AdjointTransformation(None, None, "ruled", runs_at=rule)
    assert runs_at(p, np.int64(1), jnp.int32(5), np.int16(3)) is True
    assert calls == [(1, 5, 3)] and all(type(a) is int for a in calls[0])
    p = P.AdjointTransformation(None, None, "never", runs_at=lambda b, n, s: 0)
    assert runs_at(p, 0, 1, 0) is False


# ----------------------------------------------------------------------------- stateless / identity
def test_stateless_gives_fn_the_adjoint_and_ctx_and_passes_the_state_through():
    seen = []

    def fn(g, ctx):
        seen.append(ctx)
        return g * 3.0

    p = P.stateless(fn, "triple")
    assert p.name == "triple" and p.members == () and p.runs_at is None
    assert p.init(_spec(G), None) == P.EmptyState()
    ctx, state = _ctx(2), object()
    out, new_state = p.update(jnp.asarray(G), state, ctx)
    np.testing.assert_array_equal(np.asarray(out), G * np.float32(3.0))
    assert new_state is state and seen == [ctx]


@pytest.mark.parametrize("make,name", [(lambda: P.stateless(lambda g, ctx: g, "mine"), "mine"),
                                       (P.identity, "identity")])
def test_stateless_init_refuses_a_non_float_spec_naming_the_pass(make, name):
    msg = _raises(TypeError, lambda: make().init(jax.ShapeDtypeStruct((2,), jnp.int32), None))
    assert msg == f"{name}: adjoints are floating arrays; got dtype int32"


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_identity_returns_the_adjoint_bit_for_bit(dtype):
    p = P.identity()
    g = G.astype(dtype)
    assert p.name == "identity" and p.init(_spec(g), None) == P.EmptyState()
    out, state = p.update(jnp.asarray(g), P.EmptyState(), None)
    assert out.dtype == dtype and state == P.EmptyState()
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), g.view(np.uint8))


# ----------------------------------------------------------------------------- check_adjoint / apply_pass
class _ShapeOnly:
    shape = (3,)


class _DtypeOnly:
    dtype = np.dtype(np.float32)


class _ListShaped:
    shape = [3]
    dtype = np.dtype(np.float32)


@pytest.mark.parametrize("after", [_ShapeOnly(), _DtypeOnly(), 3.0, (jnp.ones(3),)])
def test_check_adjoint_names_what_is_not_an_array(after):
    msg = _raises(TypeError, lambda: check_adjoint("p", jnp.ones(3), after))
    assert msg == f"adjoint pass 'p' returned {type(after).__name__}, expected an array"


@pytest.mark.parametrize("after,shape,dtype", [(np.ones(2, np.float32), (2,), "float32"),
                                                (np.ones(3, np.float16), (3,), "float16"),
                                                (np.ones((3, 1), np.float32), (3, 1), "float32"),
                                                (np.ones((2, 2), np.float64), (2, 2), "float64")])
def test_check_adjoint_refuses_another_shape_or_dtype_in_full(after, shape, dtype):
    msg = _raises(TypeError, lambda: check_adjoint("bad", np.zeros(3, np.float32), after))
    assert msg == (f"adjoint pass 'bad' returned an adjoint of shape {shape} dtype {dtype}; "
                   "it received shape (3,) dtype float32 and must return the same")


def test_check_adjoint_accepts_the_same_shape_and_dtype():
    assert check_adjoint("p", jnp.ones(3), jnp.zeros(3)) is None
    assert check_adjoint("p", np.ones(3, np.float32), _ListShaped()) is None  # a list shape compares as a tuple


def test_apply_pass_gives_update_its_arguments_and_returns_its_result():
    seen = []
    p = _affine(2.0, 1.0, "affine", seen)
    ctx = _ctx(1)
    out, count = apply_pass(p, jnp.asarray(G), jnp.int32(4), ctx)
    np.testing.assert_array_equal(np.asarray(out), G * np.float32(2.0) + np.float32(1.0))
    assert int(count) == 5 and seen[0][0] == "update" and int(seen[0][1]) == 4 and seen[0][2] is ctx


@pytest.mark.parametrize("result,kind", [([G, 0], "list"), ((G,), "tuple"), ((G, 0, 0), "tuple"), (G, "ndarray")])
def test_apply_pass_refuses_what_is_not_an_adjoint_state_pair(result, kind):
    p = P.AdjointTransformation(None, lambda g, s, ctx: result, "loose")
    msg = _raises(TypeError, lambda: apply_pass(p, G, None, None))
    assert msg == f"adjoint pass 'loose' must return (adjoint, state), got {kind}"


def test_apply_pass_checks_the_adjoint_against_the_one_given():
    p = P.stateless(lambda g, ctx: g[:2], "shorten")
    msg = _raises(TypeError, lambda: apply_pass(p, jnp.asarray(G), P.EmptyState(), None))
    assert msg == ("adjoint pass 'shorten' returned an adjoint of shape (2,) dtype float32; "
                   "it received shape (3,) dtype float32 and must return the same")


# ----------------------------------------------------------------------------- as_pass / from_optax
def test_as_pass_keeps_a_pass_wraps_optax_and_refuses_anything_else():
    p = P.identity()
    assert P.as_pass(p) is p
    wrapped = P.as_pass(optax.scale(0.5))
    assert isinstance(wrapped, P.AdjointTransformation) and wrapped.name.startswith("optax:")
    out, _ = wrapped.update(jnp.asarray(G), wrapped.init(_spec(G), None), None)
    np.testing.assert_array_equal(np.asarray(out), G * np.float32(0.5))
    for bad in (lambda g: g, None, (p.init, p.update)):
        msg = _raises(TypeError, lambda: P.as_pass(bad))
        assert msg == (f"{bad!r} is not an adjoint pass; expected an eae_jax.passes.AdjointTransformation "
                       "or an optax.GradientTransformation")


class _NamedTx:
    """An optax-like transform with a ``__name__``, recording what it is given."""
    __name__ = "named_tx"

    def __init__(self):
        self.seen = []

    def init(self, params):
        self.seen.append(("init", params))
        return {"count": jnp.zeros((), jnp.int32), "sum": jnp.zeros(params.shape, jnp.float32)}

    def update(self, updates, state, params=None):
        self.seen.append(("update", updates, state, params))
        # float32 updates for any adjoint: the wrapper casts back to the adjoint's dtype
        new = updates.astype(jnp.float32) * 2.0 + 1.0
        return new, {"count": state["count"] + 1, "sum": state["sum"] + new}


def test_from_optax_names_the_transform():
    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s))
    assert P.from_optax(tx).name == "optax:GradientTransformation"
    assert P.from_optax(tx, name="plain").name == "plain"
    assert P.from_optax(_NamedTx()).name == "optax:named_tx"
    assert P.from_optax(_NamedTx(), name="given").name == "given"


def test_from_optax_inits_on_zeros_and_casts_the_updates_to_the_adjoints_dtype():
    tx = _NamedTx()
    p = P.from_optax(tx)
    assert p.members == () and p.runs_at is None
    g = np.array([[1.5, -2.0, 0.25], [3.0, 0.0, -0.5]], ml_dtypes.bfloat16)
    state = p.init(_spec(g), jax.random.key(0))
    (kind, zeros), = tx.seen
    assert kind == "init" and zeros.shape == (2, 3) and zeros.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(zeros, np.float32), np.zeros((2, 3), np.float32))
    assert int(state["count"]) == 0 and state["sum"].shape == (2, 3)
    out, new_state = p.update(jnp.asarray(g), state, _ctx())
    kind, updates, given_state, params = tx.seen[1]
    assert kind == "update" and params is None and given_state is state
    np.testing.assert_array_equal(np.asarray(updates), g)
    want = g.astype(np.float32) * 2 + 1
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(out), want.astype(ml_dtypes.bfloat16))
    assert int(new_state["count"]) == 1
    np.testing.assert_array_equal(np.asarray(new_state["sum"]), want)


def test_from_optax_state_shares_no_buffer():
    z = jnp.zeros(())
    tx = optax.GradientTransformation(lambda p: (z, z), lambda u, s, p=None: (u, s))
    state = P.from_optax(tx).init(jax.ShapeDtypeStruct((3,), jnp.float32), None)
    assert len(state) == 2 and aliased_leaves(state) == []


# ----------------------------------------------------------------------------- chain
def test_chain_flattens_nested_chains_and_wraps_optax():
    a, b, c = _affine(2.0, 0.0, "a"), _affine(1.0, 1.0, "b"), P.identity()
    nested = P.chain(a, P.chain(b, P.chain(c)))
    assert nested.members == (a, b, c) and nested.runs_at is None
    assert nested.name == "chain(a, b, identity)"
    assert P.chain(a).members == (a,) and P.chain(a).name == "chain(a)"
    with_optax = P.chain(optax.scale(0.5), a)
    assert len(with_optax.members) == 2 and with_optax.members[0].name.startswith("optax:")
    assert with_optax.members[1] is a
    msg = _raises(TypeError, lambda: P.chain(a, "b"))
    assert msg.startswith("'b' is not an adjoint pass")


def test_chain_splits_the_key_once_per_member_in_order():
    seen = [[], [], []]
    members = [_affine(1.0, 0.0, f"m{i}", seen[i]) for i in range(3)]
    key = jax.random.key(11)
    g = np.zeros((2, 3), np.float16)
    flat = P.chain(*members)
    assert flat.init(_spec(g), key) == (0, 0, 0)
    want = _key_bits(jax.random.split(key, 3))
    for i in range(3):
        (kind, spec, k), = seen[i]
        assert kind == "init" and spec.shape == (2, 3) and spec.dtype == np.float16
        np.testing.assert_array_equal(_key_bits(k), want[i])
    # a nested chain draws the same keys
    nested = P.chain(members[0], P.chain(members[1], members[2]))
    nested.init(_spec(g), key)
    for i in range(3):
        np.testing.assert_array_equal(_key_bits(seen[i][1][2]), want[i])


def test_an_empty_chain_has_an_empty_state_and_changes_nothing():
    p = P.chain()
    assert p.members == () and p.name == "chain()"
    assert p.init(_spec(G), None) == ()
    out, state = p.update(jnp.asarray(G), (), _ctx())
    np.testing.assert_array_equal(np.asarray(out), G)
    assert state == ()


def test_chain_applies_its_members_left_to_right_each_with_its_own_state():
    seen_a, seen_b = [], []
    a, b = _affine(2.0, 0.0, "double", seen_a), _affine(1.0, 1.0, "plus_one", seen_b)
    ctx = _ctx(3)
    out, state = P.chain(a, b).update(jnp.asarray(G), (jnp.int32(5), jnp.int32(7)), ctx)
    np.testing.assert_array_equal(np.asarray(out), G * np.float32(2) + np.float32(1))
    assert type(state) is tuple and [int(s) for s in state] == [6, 8]
    assert int(seen_a[0][1]) == 5 and int(seen_b[0][1]) == 7 and seen_a[0][2] is ctx and seen_b[0][2] is ctx
    out, _ = P.chain(b, a).update(jnp.asarray(G), (jnp.int32(0), jnp.int32(0)), ctx)
    np.testing.assert_array_equal(np.asarray(out), (G + np.float32(1)) * np.float32(2))


def test_chain_names_the_member_that_breaks_the_adjoint():
    bad = P.stateless(lambda g, ctx: g.astype(jnp.float16), "to_fp16")
    msg = _raises(TypeError, lambda: P.chain(P.identity(), bad).update(jnp.asarray(G), ((), ()), None))
    assert msg.startswith("adjoint pass 'to_fp16' returned an adjoint of shape (3,) dtype float16")


# ----------------------------------------------------------------------------- at_layers
@pytest.mark.parametrize("layers,shown", [(0, "0"), ("01", "'01'"), (b"\x00", "b'\\x00'"), (None, "None")])
def test_at_layers_refuses_what_is_not_a_sequence_in_full(layers, shown):
    msg = _raises(TypeError, lambda: P.at_layers(P.identity(), layers))
    assert msg == f"at_layers: layers must be a sequence of ints, got {shown}"


@pytest.mark.parametrize("layers,shown", [([0, 0.5], "0.5 in (0, 0.5)"), ([True], "True in (True,)"),
                                          ((1, "2"), "'2' in (1, '2')"), ([np.float32(1)], None)])
def test_at_layers_refuses_an_entry_that_is_not_an_int_in_full(layers, shown):
    msg = _raises(TypeError, lambda: P.at_layers(P.identity(), layers))
    shown = shown or f"{layers[0]!r} in {tuple(layers)!r}"
    assert msg == f"at_layers: layers must be ints, got {shown}"


def test_at_layers_takes_any_integral_entries_as_python_ints():
    p = P.at_layers(P.identity(), iter([np.int64(1), -1]))
    assert p.name == "at_layers(identity, [1, -1])" and p.members == ()
    assert P.at_layers(optax.scale(2.0), []).name.startswith("at_layers(optax:")


def test_at_layers_applies_the_pass_only_at_its_boundaries_negative_from_the_output():
    seen = []
    inner = _affine(2.0, 1.0, "affine", seen)
    p = P.at_layers(inner, [0, -2])
    key, spec = jax.random.key(3), _spec(G)
    assert int(p.init(spec, key)) == 0 and seen[0][1] is spec and seen[0][2] is key
    chosen = {0, 2}  # of x0..x3: -2 is x2
    for b in range(4):
        ctx = _ctx(b, num=4)
        out, count = p.update(jnp.asarray(G), jnp.int32(9), ctx)
        applied = b in chosen
        np.testing.assert_array_equal(np.asarray(out), G * np.float32(2) + np.float32(1) if applied else G)
        assert int(count) == (10 if applied else 9)
        # lax.cond traces both branches: the pass is called (and given ctx) at every boundary
        assert [s[2] is ctx for s in seen[1:]] == [True]
        del seen[1:]


def test_at_layers_with_no_layers_never_applies():
    p = P.at_layers(_affine(0.0, 1.0, "ones"), [])
    assert p.name == "at_layers(ones, [])"
    for b in range(2):
        out, count = p.update(jnp.asarray(G), jnp.int32(0), _ctx(b, num=2))
        np.testing.assert_array_equal(np.asarray(out), G)
        assert int(count) == 0
    assert [runs_at(p, b, 2, 0) for b in range(2)] == [False, False]


@pytest.mark.parametrize("layers,num", [([-4], 4), ([3], 4), ([0, -1], 1), ([-2, 1], 2)])
def test_at_layers_accepts_every_index_in_range_ends_included(layers, num):
    p = P.at_layers(_affine(2.0, 0.0, "double"), layers)
    out, _ = p.update(jnp.asarray(G), jnp.int32(0), _ctx(layers[0] % num, num=num))
    np.testing.assert_array_equal(np.asarray(out), G * np.float32(2))


@pytest.mark.parametrize("layers,bad,num", [([4], [4], 4), ([-5], [-5], 4), ([0, 7, -9, 3], [7, -9], 4),
                                            ([1], [1], 1), ([-2], [-2], 1)])
def test_at_layers_refuses_an_index_out_of_range_in_full(layers, bad, num):
    p = P.at_layers(P.identity(), layers)
    msg = _raises(ValueError, lambda: p.update(jnp.asarray(G), P.EmptyState(), _ctx(0, num=num)))
    assert msg == (f"at_layers(identity): boundary indices {bad} are out of range for a stack with {num} "
                   f"boundaries (x0..x{num - 1}); use -{num} .. {num - 1}")


def test_at_layers_runs_at_its_boundaries_where_the_inner_pass_runs():
    p = P.at_layers(P.every_n_steps(P.identity(), 2), [1, -1])
    got = [[runs_at(p, b, 4, s) for b in range(4)] for s in range(3)]
    assert got == [[False, True, False, True], [False] * 4, [False, True, False, True]]
    assert p.runs_at(3, 4, 0) is True and p.runs_at(1, 4, 1) is False


# ----------------------------------------------------------------------------- every_n_steps
@pytest.mark.parametrize("n,message", [(0, "every_n_steps: n must be >= 1, got 0"),
                                       (-2, "every_n_steps: n must be >= 1, got -2")])
def test_every_n_steps_refuses_n_below_one_in_full(n, message):
    assert _raises(ValueError, lambda: P.every_n_steps(P.identity(), n)) == message


@pytest.mark.parametrize("n", [2.0, True, "3"])
def test_every_n_steps_refuses_n_that_is_not_an_int_in_full(n):
    msg = _raises(TypeError, lambda: P.every_n_steps(P.identity(), n))
    assert msg == f"every_n_steps: n must be a Python int, got {n!r}"


@pytest.mark.parametrize("n", [1, 3])
def test_every_n_steps_applies_the_pass_on_multiples_of_n_only(n):
    seen = []
    inner = _affine(2.0, 1.0, "affine", seen)
    p = P.every_n_steps(inner, np.int64(n))
    assert p.name == f"every_n_steps(affine, {n})" and p.members == ()
    key, spec = jax.random.key(5), _spec(G)
    assert int(p.init(spec, key)) == 0 and seen[0][1] is spec and seen[0][2] is key
    for step in range(7):
        ctx = _ctx(1, step=step)
        out, count = p.update(jnp.asarray(G), jnp.int32(4), ctx)
        applied = step % n == 0
        np.testing.assert_array_equal(np.asarray(out), G * np.float32(2) + np.float32(1) if applied else G)
        assert int(count) == (5 if applied else 4)
        assert [s[0] == "update" and s[2] is ctx for s in seen[1:]] == [True]  # traced on every step
        del seen[1:]


def test_every_n_steps_runs_at_multiples_of_n_where_the_inner_pass_runs():
    p = P.every_n_steps(P.at_layers(P.identity(), [0]), 3)
    assert [runs_at(p, 0, 2, s) for s in range(7)] == [True, False, False, True, False, False, True]
    assert [runs_at(p, 1, 2, s) for s in range(4)] == [False] * 4
    assert p.runs_at(0, 2, 3) is True and P.every_n_steps(optax.scale(2.0), 1).name.startswith("every_n_steps(optax:")
