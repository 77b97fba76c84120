"""The adjoint-pass protocol and its combinators.

An adjoint pass is a pair of pure functions, in the spirit of
`optax.GradientTransformation`::

    state = pass_.init(adjoint_spec, key)             # one boundary's state
    adjoint, state = pass_.update(adjoint, state, ctx)

``adjoint_spec`` is a `jax.ShapeDtypeStruct` of the adjoint at the boundary
the state belongs to; ``key`` a PRNG key for passes that draw randomness.
`eae_jax.reconstruct` keeps one state per block boundary, threads it through
the jitted step and hands every adjoint flowing between two blocks (and the
one arriving at the stack's output) to ``update`` with a `PassContext`.

``update`` must return an adjoint of the same shape and dtype; a pass that
does not is rejected at trace time with its name in the message.

An empty (size-0) adjoint is a legal adjoint: every built-in pass accepts
it at ``init`` and returns it unchanged from ``update`` with a well-defined
state (what each records is in its docstring), under jit as well.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp


class PassContext(NamedTuple):
    """What a pass may know about where it runs.

    Attributes:
      boundary: int32 scalar, the boundary index i in x0..xL the adjoint sits at.
      block: int32 scalar, the block whose input this boundary is (the seed's
        ``block_index``; ``L`` for the stack's output).
      step: int32 scalar, how many updates the carry has been through (the
        training step, counted by `Reconstructed.update`).
      num_boundaries: static int, ``L + 1``.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.passes import PassContext
      >>> ctx = PassContext(boundary=jnp.int32(2), block=jnp.int32(2), step=jnp.int32(0), num_boundaries=4)
      >>> int(ctx.boundary), ctx.num_boundaries
      (2, 4)
    """

    boundary: jax.Array
    block: jax.Array
    step: jax.Array
    num_boundaries: int


class AdjointTransformation(NamedTuple):
    """A pure adjoint pass: ``init(spec, key) -> state`` and
    ``update(adjoint, state, ctx) -> (adjoint, state)``.

    Attributes:
      init: builds the state of one boundary.
      update: transforms one adjoint.
      name: used in error messages, events and stats.
      members: for a `chain`, the flattened passes it is made of.
      runs_at: host-side rule ``(boundary, num_boundaries, step) -> bool``
        saying where ``update`` really applies the pass (`at_layers`,
        `every_n_steps`); None: at every boundary and step. Events use it
        to report only statistics measured in the step.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import AdjointTransformation, EmptyState
      >>> halve = AdjointTransformation(lambda spec, key: EmptyState(), lambda g, s, ctx: (g / 2, s), name="halve")
      >>> g = jnp.ones(3)
      >>> halve.update(g, halve.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)[0].tolist()
      [0.5, 0.5, 0.5]
    """

    init: Callable[[jax.ShapeDtypeStruct, jax.Array], Any]
    update: Callable[[jax.Array, Any, PassContext], tuple]
    name: str = "pass"
    members: tuple = ()
    runs_at: Optional[Callable[[int, int, int], bool]] = None


def runs_at(pass_: AdjointTransformation, boundary: int, num_boundaries: int, step: int) -> bool:
    """Whether ``pass_`` is applied at ``boundary`` of a stack with
    ``num_boundaries`` boundaries in train step ``step`` (host-side).

    Example:
      >>> from eae_jax.passes import at_layers, every_n_steps, identity
      >>> from eae_jax.passes.base import runs_at
      >>> [runs_at(at_layers(identity(), [-1]), b, num_boundaries=4, step=0) for b in range(4)]
      [False, False, False, True]
      >>> [runs_at(every_n_steps(identity(), 2), 0, num_boundaries=4, step=s) for s in range(3)]
      [True, False, True]
    """
    rule = getattr(pass_, "runs_at", None)
    return True if rule is None else bool(rule(int(boundary), int(num_boundaries), int(step)))


class EmptyState(NamedTuple):
    """State of a stateless pass.

    Example:
      >>> import jax
      >>> from eae_jax.passes import EmptyState, identity
      >>> identity().init(jax.ShapeDtypeStruct((2,), "float32"), None) == EmptyState()
      True
    """


def stateless(fn: Callable[[jax.Array, PassContext], jax.Array], name: str) -> AdjointTransformation:
    """Wrap ``fn(adjoint, ctx) -> adjoint`` as a pass with no state.

    ``init`` checks that it is given a floating adjoint spec (TypeError
    naming the pass otherwise).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import stateless
      >>> negate = stateless(lambda g, ctx: -g, "negate")
      >>> g = jnp.array([1.0, -2.0])
      >>> state = negate.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None)
      >>> negate.update(g, state, None)[0].tolist(), state
      ([-1.0, 2.0], EmptyState())
    """

    def init(spec, key):
        del key
        from eae_jax.passes._util import require_float_spec

        require_float_spec(name, spec)
        return EmptyState()

    def update(adjoint, state, ctx):
        return fn(adjoint, ctx), state

    return AdjointTransformation(init, update, name)


def check_adjoint(name: str, before: jax.Array, after: Any) -> None:
    """Raise TypeError naming the pass when it changed the adjoint's shape or dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.passes.base import check_adjoint
      >>> check_adjoint("same", jnp.ones(3), jnp.zeros(3))
      >>> check_adjoint("shorter", jnp.ones(3), jnp.ones(2))
      Traceback (most recent call last):
      ...
      TypeError: adjoint pass 'shorter' returned an adjoint of shape (2,) dtype float32; it received shape (3,) ...
    """
    if not hasattr(after, "shape") or not hasattr(after, "dtype"):
        raise TypeError(f"adjoint pass {name!r} returned {type(after).__name__}, expected an array")
    if tuple(after.shape) != tuple(before.shape) or after.dtype != before.dtype:
        raise TypeError(
            f"adjoint pass {name!r} returned an adjoint of shape {tuple(after.shape)} dtype {after.dtype}; "
            f"it received shape {tuple(before.shape)} dtype {before.dtype} and must return the same"
        )


def apply_pass(pass_: AdjointTransformation, adjoint: jax.Array, state: Any, ctx: PassContext):
    """Run ``pass_.update`` and check the result (see `check_adjoint`).

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.passes import EmptyState, decay, stateless
      >>> from eae_jax.passes.base import apply_pass
      >>> apply_pass(decay(0.5), jnp.ones(2), EmptyState(), None)[0].tolist()
      [0.5, 0.5]
      >>> apply_pass(stateless(lambda g, ctx: g.astype("float16"), "to_fp16"), jnp.ones(2), EmptyState(), None)
      Traceback (most recent call last):
      ...
      TypeError: adjoint pass 'to_fp16' returned an adjoint of shape (2,) dtype float16; ...
    """
    result = pass_.update(adjoint, state, ctx)
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"adjoint pass {pass_.name!r} must return (adjoint, state), got {type(result).__name__}")
    new_adjoint, new_state = result
    check_adjoint(pass_.name, adjoint, new_adjoint)
    return new_adjoint, new_state


def as_pass(obj: Any) -> AdjointTransformation:
    """Coerce ``obj`` into an `AdjointTransformation`.

    Accepts an `AdjointTransformation`, or an `optax.GradientTransformation`
    (wrapped with `from_optax`).

    Raises:
      TypeError: anything else.

    Example:
      >>> import optax
      >>> from eae_jax.passes import as_pass, clip_by_norm
      >>> as_pass(clip_by_norm(1.0)).name, as_pass(optax.scale(0.5)).name.startswith("optax:")
      ('clip_by_norm(1)', True)
      >>> as_pass(lambda g: g)
      Traceback (most recent call last):
      ...
      TypeError: <function <lambda> at ...> is not an adjoint pass; expected an eae_jax.passes.AdjointTransformation ...
    """
    if isinstance(obj, AdjointTransformation):
        return obj
    try:
        import optax

        if isinstance(obj, optax.GradientTransformation):
            return from_optax(obj)
    except ImportError:  # pragma: no cover - optax is a hard dependency
        pass
    raise TypeError(
        f"{obj!r} is not an adjoint pass; expected an eae_jax.passes.AdjointTransformation "
        "or an optax.GradientTransformation"
    )


def from_optax(tx: Any, name: str | None = None) -> AdjointTransformation:
    """Use an `optax.GradientTransformation` as an adjoint pass.

    The adjoint is handed to ``tx.update`` as the "updates" of a single
    array; params are not given (transforms that need them, such as weight
    decay, do not make sense on an adjoint). ``tx.init`` sees a zero array of
    the adjoint's shape. Examples: `optax.clip_by_global_norm`,
    `optax.add_noise`, `optax.scale`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from eae_jax.passes import from_optax
      >>> p = from_optax(optax.clip_by_global_norm(1.0), name="clip_global")
      >>> g = jnp.array([3.0, 4.0])
      >>> out, _ = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None), None)
      >>> p.name, [round(float(x), 4) for x in out]
      ('clip_global', [0.6, 0.8])
    """
    label = name or f"optax:{getattr(tx, '__name__', type(tx).__name__)}"

    def init(spec, key):
        del key
        from eae_jax.buffers import unalias

        # An optax state may reuse one array for several fields; a donated carry cannot hold that.
        return unalias(tx.init(jnp.zeros(spec.shape, spec.dtype)))

    def update(adjoint, state, ctx):
        del ctx
        updates, state = tx.update(adjoint, state)
        return updates.astype(adjoint.dtype), state

    return AdjointTransformation(init, update, label)


def chain(*passes: Any) -> AdjointTransformation:
    """Compose passes left to right: the adjoint goes through each in order.

    Nested chains are flattened, so ``chain(a, chain(b, c))`` and
    ``chain(a, b, c)`` have the same state structure and draw the same keys.
    optax transforms are accepted and wrapped with `from_optax`.

    The state is a tuple with one entry per member; the key given to
    ``init`` is split once per member.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import chain, clip_by_norm, decay
      >>> p = chain(decay(0.5), chain(clip_by_norm(1.0)))      # flattened: two members
      >>> g = jnp.array([3.0, 4.0])
      >>> out, state = p.update(g, p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0)), None)
      >>> p.name, [round(float(x), 4) for x in out], float(state[1].norm)   # the norm clip saw: 2.5
      ('chain(decay(0.5), clip_by_norm(1))', [0.6, 0.8], 2.5)
    """
    members = []
    for p in passes:
        p = as_pass(p)
        members.extend(p.members if p.members else (p,))
    members = tuple(members)

    def init(spec, key):
        if not members:
            return ()
        keys = jax.random.split(key, len(members))
        return tuple(m.init(spec, k) for m, k in zip(members, keys))

    def update(adjoint, state, ctx):
        new_states = []
        for m, s in zip(members, state):
            adjoint, s = apply_pass(m, adjoint, s, ctx)
            new_states.append(s)
        return adjoint, tuple(new_states)

    name = "chain(" + ", ".join(m.name for m in members) + ")"
    return AdjointTransformation(init, update, name, members)


def identity() -> AdjointTransformation:
    """The pass that leaves the adjoint alone (what ``passes=None`` means).

    Example:
      >>> import jax.numpy as jnp
      >>> from eae_jax.passes import EmptyState, identity
      >>> identity().update(jnp.array([1.0, 2.0]), EmptyState(), None)[0].tolist()
      [1.0, 2.0]
    """
    return stateless(lambda g, ctx: g, "identity")


def at_layers(pass_: Any, layers: Sequence[int]) -> AdjointTransformation:
    """Apply ``pass_`` only at the given boundary indices.

    Elsewhere the adjoint and the state pass through untouched. Negative
    indices count from the output (``-1`` is boundary L). The choice is made
    with `jax.lax.cond` on the traced boundary index, so it works inside the
    scan over depth.

    Raises:
      TypeError: ``layers`` is not a sequence of Python ints.
      ValueError (at trace time): an index outside ``[-(L+1), L]`` for a
        stack with boundaries x0..xL (it would otherwise wrap around).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import PassContext, at_layers, decay
      >>> p = at_layers(decay(1.0), [-1])        # zero the adjoint at the stack's output x2 only
      >>> g = jnp.ones(2)
      >>> state = p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None)
      >>> [p.update(g, state, PassContext(jnp.int32(b), jnp.int32(b), jnp.int32(0), 3))[0].tolist() for b in range(3)]
      [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    """
    import numbers

    inner = as_pass(pass_)
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"at_layers: layers must be a sequence of ints, got {layers!r}")
    layers = tuple(layers)
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"at_layers: layers must be ints, got {i!r} in {layers!r}")
    layers = tuple(int(i) for i in layers)

    def init(spec, key):
        return inner.init(spec, key)

    def update(adjoint, state, ctx):
        num = ctx.num_boundaries
        bad = [i for i in layers if not -num <= i < num]
        if bad:
            raise ValueError(
                f"at_layers({inner.name}): boundary indices {bad} are out of range for a stack with {num} "
                f"boundaries (x0..x{num - 1}); use -{num} .. {num - 1}"
            )
        wanted = jnp.asarray([i % num for i in layers], jnp.int32)
        active = jnp.any(ctx.boundary == wanted) if layers else jnp.asarray(False)
        return jax.lax.cond(
            active,
            lambda a, s: apply_pass(inner, a, s, ctx),
            lambda a, s: (a, s),
            adjoint,
            state,
        )

    def where(boundary, num, step):
        return boundary in {i % num for i in layers} and runs_at(inner, boundary, num, step)

    return AdjointTransformation(init, update, f"at_layers({inner.name}, {list(layers)})", runs_at=where)


def every_n_steps(pass_: Any, n: int) -> AdjointTransformation:
    """Apply ``pass_`` only on steps that are multiples of ``n``.

    Raises:
      TypeError / ValueError: ``n`` is not a Python int >= 1.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from eae_jax.passes import PassContext, decay, every_n_steps
      >>> p = every_n_steps(decay(0.5), 2)
      >>> g = jnp.ones(1)
      >>> state = p.init(jax.ShapeDtypeStruct(g.shape, g.dtype), None)
      >>> [p.update(g, state, PassContext(jnp.int32(0), jnp.int32(0), jnp.int32(s), 2))[0].tolist() for s in range(3)]
      [[0.5], [1.0], [0.5]]
    """
    from eae_jax.passes._util import require_int

    inner = as_pass(pass_)
    n = require_int("every_n_steps", "n", n, low=1)

    def update(adjoint, state, ctx):
        return jax.lax.cond(
            ctx.step % n == 0,
            lambda a, s: apply_pass(inner, a, s, ctx),
            lambda a, s: (a, s),
            adjoint,
            state,
        )

    def when(boundary, num, step):
        return step % n == 0 and runs_at(inner, boundary, num, step)

    return AdjointTransformation(inner.init, update, f"every_n_steps({inner.name}, {n})", runs_at=when)
