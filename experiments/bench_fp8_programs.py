"""The JAX programs the fp8 campaign times (`bench_fp8_campaign.py`): the
SwiGLU FFN in each variant, whole language-model train steps, and the
gradient comparison. Imported by `bench_fp8_child.py`.

Ours is `eae_jax.fp8` with the recipe, guard and fallback the training
command uses (`TrainConfig` defaults for ``--dtype fp8_e4m3``: delayed
activation, weight and gradient scales, weights cast once per step, the
``step`` guard), and the same recipe unguarded (``check_values=False``, no
cond). Flax is `flax.linen.Fp8DirectDotGeneralOp` / `Fp8Einsum` (delayed
per-tensor scaling from a 1024-step amax history for input, kernel and
output gradient; no guard), in the same LLaMA block: gate and up joined
into one GEMM and q, k, v into one, as ours joins them, from the same
params (separate weights, joined inside the call on both sides).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax import fp8
from eae_jax.blocks import BlockConfig, causal_attention, decoder_block
from eae_jax.models.llama import cross_entropy, embed, lm_stack, split_params
from eae_jax.train.config import TrainConfig
from eae_jax.train.loop import make_optimizer

#: Flax's fp8 variables live in this collection; their gradient is their next value.
FLAX_COLLECTION = "_overwrite_with_gradient"
#: Flax's fp8 op kinds: ``direct`` (`Fp8DirectDotGeneralOp`), ``einsum`` (`Fp8Einsum`).
FLAX_KINDS = ("direct", "einsum")


def train_fp8_recipe() -> Dict[str, str]:
    """What ``eae-jax train --dtype fp8_e4m3`` uses, read from `TrainConfig`'s
    defaults: activation, weight and gradient scaling and the fallback.

    >>> sorted(train_fp8_recipe())
    ['activation', 'fallback', 'gradient', 'weight']
    """
    cfg = TrainConfig(dtype="fp8_e4m3")
    return {"activation": cfg.fp8_scaling, "weight": cfg.fp8_weight_scaling, "gradient": cfg.fp8_grad_scaling,
            "fallback": cfg.fp8_fallback}


# ---------------------------------------------------------------------- Flax's fp8 ops
def flax_fp8():
    """``(Fp8DirectDotGeneralOp, Fp8Einsum, fp8_ops)`` of the installed flax;
    RuntimeError naming what this flax lacks."""
    try:
        import flax.linen as nn
        from flax.linen import fp8_ops
    except Exception as err:  # the comparison needs flax; say so plainly
        raise RuntimeError(f"flax is not importable: {err}") from err
    missing = [n for n in ("Fp8DirectDotGeneralOp", "Fp8Einsum") if not hasattr(nn, n)]
    missing += [n for n in ("in_q", "quantized_dot", "out_dq", "update_fp8_meta") if not hasattr(fp8_ops, n)]
    if missing:
        raise RuntimeError(f"this flax lacks {missing}")
    return nn.Fp8DirectDotGeneralOp, nn.Fp8Einsum, fp8_ops


def flax_vars(kind: str = "direct") -> Dict[str, jax.Array]:
    """Fresh variables of one Flax fp8 op (scales 1, empty amax histories).

    >>> sorted(flax_vars())[:2]
    ['input_amax_history', 'input_scale']
    """
    direct, einsum, _ = flax_fp8()
    x, k = jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((3, 4), jnp.bfloat16)
    if kind == "direct":
        v = direct().init(jax.random.key(0), x, k, (((1,), (1,)), ((), ())))
    elif kind == "einsum":
        v = einsum().init(jax.random.key(0), "mk,nk->mn", x, k)
    else:
        raise ValueError(f"unknown Flax fp8 op {kind!r}; expected one of {FLAX_KINDS}")
    return dict(v[FLAX_COLLECTION])


def flax_dot(kind: str, v: Dict[str, jax.Array], x: jax.Array, k: jax.Array) -> jax.Array:
    """``x @ k.T`` (``k`` ``(N, K)``, ``x`` ``(..., K)``) through Flax's fp8 op.

    >>> x, k = jnp.ones((2, 4), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    >>> flax_dot("direct", flax_vars(), x, k).shape
    (2, 3)
    """
    direct, einsum, _ = flax_fp8()
    if kind == "direct":
        return direct().apply({FLAX_COLLECTION: v}, x, k, (((x.ndim - 1,), (1,)), ((), ())))
    if kind == "einsum":
        return einsum().apply({FLAX_COLLECTION: v}, "...k,nk->...n", x, k)
    raise ValueError(f"unknown Flax fp8 op {kind!r}; expected one of {FLAX_KINDS}")


def flax_cast_kernel(v: Dict[str, jax.Array], k: jax.Array):
    """``(q, scale)``: a kernel quantized the way Flax's op quantizes it in
    every call (`fp8_ops.in_q` at the scale its amax history gives), here
    once, ahead of the calls (the pre-cast comparison)."""
    _, _, ops = flax_fp8()
    return ops.in_q(k.dtype, jnp.float8_e4m3fn, k, v["kernel_scale"], v["kernel_amax_history"])


def flax_dot_precast(v: Dict[str, jax.Array], x: jax.Array, k: jax.Array, kq: jax.Array, ks: jax.Array):
    """`flax_dot` with the kernel quantized beforehand (`flax_cast_kernel`):
    Flax's own pieces (`fp8_ops.in_q` for ``x``, `quantized_dot`, `out_dq`)
    without the kernel's quantization. ``k`` is read only for its shape and
    receives the gradient, as in Flax's op.

    >>> x, k = jnp.ones((2, 4), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    >>> v = flax_vars()
    >>> flax_dot_precast(v, x, k, *flax_cast_kernel(v, k)).shape
    (2, 3)
    """
    _, _, ops = flax_fp8()
    x = x.astype(k.dtype)
    qx, xs = ops.in_q(k.dtype, jnp.float8_e4m3fn, x, v["input_scale"], v["input_amax_history"])
    y = ops.quantized_dot(x, qx, xs, k, kq, ks, v["output_grad_scale"], v["output_grad_amax_history"],
                          (((x.ndim - 1,), (1,)), ((), ())), x.dtype)
    return ops.out_dq(x.dtype, xs, ks, y)


def _hidden(a: jax.Array, f: int, dtype) -> jax.Array:
    """SwiGLU's hidden from the joined gate-up output, as our seam computes it
    (silu and product in float32, then the compute dtype)."""
    return (jax.nn.silu(a[..., :f].astype(jnp.float32)) * a[..., f:].astype(jnp.float32)).astype(dtype)


def flax_ffn(kind: str, vs: Dict[str, Dict], p: dict, h: jax.Array) -> jax.Array:
    """SwiGLU through Flax's fp8 ops: gate and up joined into one GEMM (``vs['gu']``), then down (``vs['down']``).

    >>> from eae_jax.blocks import init_swiglu
    >>> p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(jax.random.key(0), 8, 16))
    >>> flax_ffn("direct", {"gu": flax_vars(), "down": flax_vars()}, p, jnp.ones((2, 8), jnp.bfloat16)).shape
    (2, 8)
    """
    a = flax_dot(kind, vs["gu"], h, jnp.concatenate([p["w_gate"], p["w_up"]], axis=0))
    return flax_dot(kind, vs["down"], _hidden(a, p["w_gate"].shape[0], h.dtype), p["w_down"])


def flax_ffn_precast(vs: Dict[str, Dict], p: dict, casts: Dict[str, tuple], h: jax.Array) -> jax.Array:
    """`flax_ffn` with kernels cast beforehand: ``casts`` from `flax_ffn_casts`."""
    k_gu = jnp.concatenate([p["w_gate"], p["w_up"]], axis=0)  # its shape only: no copy survives
    a = flax_dot_precast(vs["gu"], h, k_gu, *casts["gu"])
    return flax_dot_precast(vs["down"], _hidden(a, p["w_gate"].shape[0], h.dtype), p["w_down"], *casts["down"])


def flax_ffn_casts(vs: Dict[str, Dict], p: dict) -> Dict[str, tuple]:
    """The FFN's kernels quantized once (`flax_cast_kernel`)."""
    return {"gu": flax_cast_kernel(vs["gu"], jnp.concatenate([p["w_gate"], p["w_up"]], axis=0)),
            "down": flax_cast_kernel(vs["down"], p["w_down"])}


FLAX_BLOCK_OPS = ("qkv", "o", "gu", "down")


def flax_block_state(depth: int, kind: str = "direct") -> Dict[str, Dict[str, jax.Array]]:
    """Fresh Flax fp8 variables for every op of ``depth`` blocks (leading depth axis).

    >>> flax_block_state(3)["qkv"]["input_amax_history"].shape
    (3, 1024)
    """
    one = flax_vars(kind)
    return {op: {n: jnp.stack([a] * depth) for n, a in one.items()} for op in FLAX_BLOCK_OPS}


def flax_block(cfg: BlockConfig, kind: str = "direct") -> Callable:
    """``block(p, x)``, ``p = {'params', 'flax'}``: the same decoder block with
    its q/k/v projections (joined), output projection and FFN through
    Flax's fp8 ops. The Flax variables stay in float32 (the block casts only
    ``p['params']`` to the compute dtype); the gradient with respect to
    ``p['flax']`` is their next value.

    >>> from eae_jax.blocks import init_block
    >>> cfg = BlockConfig(dim=16, num_heads=2, num_kv_heads=1, ffn_hidden_dim=32, compute_dtype="bf16")
    >>> p = {"params": init_block(jax.random.key(0), cfg),
    ...      "flax": jax.tree_util.tree_map(lambda a: a[0], flax_block_state(1))}
    >>> flax_block(cfg)(p, jnp.ones((1, 4, 16))).shape
    (1, 4, 16)
    """
    def block(p, x):
        vs = p["flax"]

        def qkv(ap, h):
            y = flax_dot(kind, vs["qkv"], h, jnp.concatenate([ap["wq"], ap["wk"], ap["wv"]], axis=0))
            nq, nk = ap["wq"].shape[0], ap["wk"].shape[0]
            return y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:]

        attention = functools.partial(causal_attention, project_qkv=qkv,
                                      project_out=lambda ap, o: flax_dot(kind, vs["o"], o, ap["wo"]))
        inner = decoder_block(cfg, ffn_fn=lambda fp, h: flax_ffn(kind, vs, fp, h), attention_fn=attention)
        return inner(p["params"], x)

    block.__name__ = f"flax_fp8_{kind}_block"
    return block


# ---------------------------------------------------------------------- FFN variants
#: FFN variants: bf16; ours (guarded: the lone seam's default, one lax.cond per
#: call; ``-u`` unguarded) with the weights cast inside the timed call (``in``)
#: or beforehand (``pre``); Flax's ops (weights quantized in every call) and
#: Flax's pieces with the kernels quantized beforehand.
FFN_VARIANTS = ("bf16", "eae-in", "eae-in-u", "eae-pre", "eae-pre-u", "flax-direct", "flax-einsum", "flax-pre")


def _fb(apply: Callable, argnums: tuple) -> Callable:
    """Forward + backward of ``apply``: ``fb(*args, ct)`` -> (loss, grads); the
    cotangent is an argument (a closed-over one would be a multi-MB literal)."""
    def fb(*a):
        *a, ct = a

        def loss(*b):
            return jnp.sum(apply(*b).astype(jnp.float32) * ct.astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=argnums)(*a)
    return fb


def ffn_inputs(m: int, d: int, f: int, seed: int = 0) -> Dict[str, Any]:
    """bf16 SwiGLU params, RMS-normalized inputs (the seam's input is a norm's
    output), calibration samples with their residuals, and a cotangent."""
    from eae_jax.blocks import init_swiglu, rms_norm

    keys = jax.random.split(jax.random.key(seed), 6)
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), init_swiglu(keys[0], d, f))
    ones = {"scale": jnp.ones((d,), jnp.float32)}

    def sample(k):
        r = jax.random.normal(k, (m, d), jnp.float32)
        return r.astype(jnp.bfloat16), rms_norm(ones, r).astype(jnp.bfloat16)

    _, h = sample(keys[1])
    cal = [sample(keys[2]), sample(keys[3])]
    ct = jax.random.normal(keys[4], (m, d), jnp.float32).astype(jnp.bfloat16)
    return {"p": p, "h": h, "cal": cal, "ct": ct}


def ffn_programs(inputs: Dict[str, Any], variants=FFN_VARIANTS, flax_warmup: int = 3,
                 errors: Optional[Dict[str, str]] = None) -> Dict[str, dict]:
    """``{variant: {'fwd': (fn, args), 'fb': (fn, args)}}`` for the FFN variants.

    Ours binds the seam (calibration, gate) with the training command's
    recipe, observes gradient scales with one current-scaling backward and
    folds them in; Flax's variables are warmed by ``flax_warmup`` forward +
    backward calls (a fresh op scales by 1 until its histories fill). Every
    variant gets the same params, input and cotangent. ``errors``: a dict
    that receives ``{variant: why}`` for an fp8 variant that fails to build
    (the others are still built); without it the failure raises.
    """
    unknown = sorted(set(variants) - set(FFN_VARIANTS))
    if unknown:
        raise ValueError(f"unknown FFN variant(s) {unknown}; expected some of {FFN_VARIANTS}")
    p, h, ct = inputs["p"], inputs["h"], inputs["ct"]
    from eae_jax.blocks import swiglu

    out: Dict[str, dict] = {}
    if "bf16" in variants:
        out["bf16"] = {"fwd": (swiglu, (p, h)), "fb": (_fb(swiglu, (0, 1)), (p, h, ct))}
    recipe = {k: v for k, v in train_fp8_recipe().items() if k != "fallback"}
    shared: Dict[str, Any] = {}

    def observed_state():
        # One bind and one observing backward serve every variant of ours.
        if "state" not in shared:
            seam0 = fp8.ffn_seam(**{**recipe, "gradient": "current"})
            bound = fp8.bind(seam0, p, [c[1] for c in inputs["cal"]], residuals=[c[0] for c in inputs["cal"]])
            observe = jax.jit(_fb(lambda s, pp, x: fp8.apply(seam0, s, pp, x), (0,)))
            state = fp8.fold_state(seam0, bound.state, observe(bound.state, p, h, ct)[1][0])
            if not bool(jnp.all(state.grad_scales > 0)):
                raise RuntimeError("the current-scaling backward observed no gradient scales")
            shared["state"] = state
        return shared["state"]

    def build_ours(v):
        state = observed_state()
        seam = fp8.ffn_seam(**recipe, check_values=not v.endswith("-u"))
        if "-in" in v:
            def apply(s, pp, x):
                return fp8.apply(seam, fp8.cast_weights(seam, s, pp), pp, x)
            st = state
        else:
            def apply(s, pp, x):
                return fp8.apply(seam, s, pp, x)
            st = jax.jit(functools.partial(fp8.cast_weights, seam))(state, p)
        return {"fwd": (apply, (st, p, h)), "fb": (_fb(apply, (0, 1, 2)), (st, p, h, ct))}

    def build_flax(v):
        kind = "direct" if v in ("flax-direct", "flax-pre") else "einsum"
        vs = {"gu": flax_vars(kind), "down": flax_vars(kind)}
        warm = jax.jit(_fb(lambda vv, pp, x: flax_ffn(kind, vv, pp, x), (0,)))
        for _ in range(flax_warmup):
            vs = warm(vs, p, h, ct)[1][0]
        if v == "flax-pre":
            def apply(vv, pp, x, cc):
                return flax_ffn_precast(vv, pp, cc, x)
            casts = jax.jit(flax_ffn_casts)(vs, p)
            return {"fwd": (apply, (vs, p, h, casts)), "fb": (_fb(apply, (0, 1, 2)), (vs, p, h, casts, ct))}

        def apply(vv, pp, x):
            return flax_ffn(kind, vv, pp, x)
        return {"fwd": (apply, (vs, p, h)), "fb": (_fb(apply, (0, 1, 2)), (vs, p, h, ct))}

    for v in variants:
        if v == "bf16":
            continue
        try:
            out[v] = build_ours(v) if v.startswith("eae-") else build_flax(v)
        except Exception as err:  # one variant's failure is its row's, not the campaign's
            if errors is None:
                raise
            errors[v] = f"{type(err).__name__}: {str(err)[:500]}"
    return out


# ---------------------------------------------------------------------- LM train steps
#: Whole train steps: bf16; ours with the training command's fp8 configuration
#: (step guard) and the same recipe unguarded; Flax's fp8 ops in the same block.
STEP_VARIANTS = ("bf16", "eae-fp8", "eae-fp8-u", "flax-fp8")


def lm_config(preset: str, dtype: str, smoke: bool = False):
    """The `LMConfig` a training run of ``preset`` in ``dtype`` builds (`TrainConfig.model`);
    ``smoke``: a tiny model of the same structure (CPU)."""
    if smoke:
        return TrainConfig(preset="tiny", dtype=dtype, vocab_size=64, seq_len=32, batch=2, depth=2).model()
    return TrainConfig(preset=preset, dtype=dtype).model()


def batch_shape(preset: str, smoke: bool = False) -> Tuple[int, int]:
    """``(batch, seq)`` of a preset's train step (the preset's own)."""
    if smoke:
        return 2, 32
    cfg = TrainConfig(preset=preset)
    return cfg.batch, cfg.seq_len


def eae_block(model, params: dict, tokens: jax.Array, guarded: bool = True) -> "fp8.BoundBlock":
    """Our fp8 seams bound as the training command binds them (`bind_fp8`:
    calibrated and gated on the embedded batch), with current gradient
    scaling (the first step observes the scales). ``guarded=False``: no
    value checks and no cond (``check_values=False``, folded per step)."""
    recipe = train_fp8_recipe()
    policy = TrainConfig(dtype="fp8_e4m3").policy_obj
    seams = fp8.policy_seams(policy, activation=recipe["activation"], weight=recipe["weight"])
    x0 = embed(params["embed"], tokens[:, :-1], model.block.compute_dtype)
    bound = fp8.bind_block(model.block, params["blocks"], [x0], seams, fallback=recipe["fallback"])
    return bound if guarded else unguarded(bound)


def unguarded(bound: "fp8.BoundBlock") -> "fp8.BoundBlock":
    """The same seams without value checks: no cond anywhere, folded per step."""
    return bound.with_recipe(check_values=False).with_fallback("block")


def delayed(bound: "fp8.BoundBlock") -> "fp8.BoundBlock":
    """``bound`` with the training command's gradient scaling (delayed once observed)."""
    return bound.with_recipe(gradient=train_fp8_recipe()["gradient"])


def loss_fn(model, kind: str, bound=None, flax_kind: str = "direct") -> Callable:
    """``loss(params, block_state, tokens)``: the LM's mean cross-entropy with
    the block of ``kind`` (``bf16``/``f32``: the plain block; ``eae``: ours,
    ``block_state`` its seam states; ``flax``: Flax's ops, its variables)."""
    block_fn = {"eae": lambda: bound.block_fn(), "flax": lambda: flax_block(model.block, flax_kind)}.get(
        kind, lambda: None)()
    stack = lm_stack(model, block_fn=block_fn)
    slot = {"eae": "fp8", "flax": "flax"}.get(kind)

    def loss(params, bstate, tokens):
        e, b, h = split_params(params, model)
        seg = [e, b if slot is None else {"params": b, slot: bstate}, h]
        return cross_entropy(stack(seg, tokens[:, :-1]), tokens[:, 1:])

    return loss


def train_step(model, kind: str, tx, bound=None, flax_kind: str = "direct") -> Callable:
    """``step(params, opt_state, block_state, tokens) -> (params, opt_state,
    block_state, loss, rejected)``: one AdamW step (`make_optimizer`'s, as
    the training command), the same function for every variant but for the
    block and its state. Ours as `eae_jax.train.loop.make_train_step` does
    it: weights cast once per step when their scales are delayed, then
    ``fold_step`` and the update under the step guard's cond (``fold``
    without it); Flax's variables take their gradient (their next value)."""
    loss = loss_fn(model, kind, bound, flax_kind)
    has_state = kind in ("eae", "flax")
    cast = kind == "eae" and any(s.recipe.weight == "delayed" for s in bound.seams.values())

    def update(ops):
        grads, opt_state, params = ops
        import optax

        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(params, opt_state, bstate, tokens):
        used = bound.cast_weights(bstate, params["blocks"]) if cast else bstate
        if has_state:
            value, (grads, gstate) = jax.value_and_grad(loss, argnums=(0, 1))(params, used, tokens)
        else:
            value, grads = jax.value_and_grad(loss)(params, used, tokens)
        rejected = jnp.zeros((), jnp.bool_)
        if kind == "eae" and bound.fallback == "step":
            bstate, rejected = bound.fold_step(bstate, gstate)
            params, opt_state = jax.lax.cond(rejected, lambda ops: (ops[2], ops[1]), update,
                                             (grads, opt_state, params))
            return params, opt_state, bstate, value, rejected
        if kind == "eae":
            bstate = bound.fold(used, gstate)
        elif kind == "flax":
            bstate = gstate
        params, opt_state = update((grads, opt_state, params))
        return params, opt_state, bstate, value, rejected

    return step


def optimizer():
    """The training command's optimizer (clip by global norm, AdamW with its schedule)."""
    return make_optimizer(TrainConfig())


def grad_fn(model, kind: str, bound=None, flax_kind: str = "direct") -> Callable:
    """``grads(params, block_state, tokens) -> (loss, param grads, block-state grads)``
    (weights cast first where ours casts them)."""
    loss = loss_fn(model, kind, bound, flax_kind)
    cast = kind == "eae" and any(s.recipe.weight == "delayed" for s in bound.seams.values())

    def grads(params, bstate, tokens):
        used = bound.cast_weights(bstate, params["blocks"]) if cast else bstate
        value, (g, gs) = jax.value_and_grad(loss, argnums=(0, 1))(params, used, tokens)
        return value, g, gs

    return grads


# ---------------------------------------------------------------------- agreement
def leaves_by_name(tree: Any) -> Dict[str, Any]:
    """``{'blocks/ffn/w_up': leaf, ...}``: a pytree's leaves by their key paths.

    >>> list(leaves_by_name({"a": {"b": 1}, "c": [2]}))
    ['a/b', 'c/0']
    """
    def part(k):
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    return {"/".join(part(k) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def grad_agreement(grads: Any, ref: Any) -> Dict[str, Any]:
    """Cosines of ``grads`` against ``ref`` (same pytree): per leaf, the
    smallest per-layer one of each stacked block leaf, the smallest leaf
    cosine, their mean weighted by leaf size, and the cosine of the whole
    gradient (leaves weighted by their norms).

    >>> g = {"a": jnp.ones((2, 3)), "b": jnp.array([1.0, 0.0])}
    >>> r = {"a": jnp.ones((2, 3)), "b": jnp.array([0.0, 1.0])}
    >>> out = grad_agreement(g, r)
    >>> out["per_leaf"]["b"], out["min_leaf"], round(out["size_weighted"], 4)
    (0.0, 0.0, 0.75)
    """
    flat, rflat = leaves_by_name(grads), leaves_by_name(ref)
    if set(flat) != set(rflat):
        raise ValueError(f"gradient trees differ: {sorted(set(flat) ^ set(rflat))}")

    @jax.jit
    def sums(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        axes = tuple(range(1, a.ndim))
        return jnp.sum(a * b, axis=axes), jnp.sum(a * a, axis=axes), jnp.sum(b * b, axis=axes)

    def cos(ab, aa, bb):
        return float(ab / np.sqrt(aa * bb)) if aa > 0 and bb > 0 else (1.0 if aa == bb == 0 else 0.0)

    per_leaf, per_layer_min, tot, sizes = {}, {}, np.zeros(3), {}
    for name, a in flat.items():
        b = rflat[name]
        if a.shape != b.shape:
            raise ValueError(f"gradient {name}: shape {a.shape} against {b.shape}")
        stacked = a.ndim >= 2 and "blocks" in name
        ab, aa, bb = (np.asarray(s, np.float64) for s in sums(a if stacked else a[None], b if stacked else b[None]))
        per_leaf[name] = cos(ab.sum(), aa.sum(), bb.sum())
        if stacked:
            per_layer_min[name] = min(cos(*t) for t in zip(ab, aa, bb))
        tot += (ab.sum(), aa.sum(), bb.sum())
        sizes[name] = int(np.prod(a.shape))
    total = sum(sizes.values())
    return {"per_leaf": per_leaf, "per_layer_min": per_layer_min, "min_leaf": min(per_leaf.values()),
            "min_layer": min(list(per_layer_min.values()) or [min(per_leaf.values())]),
            "size_weighted": sum(per_leaf[n] * sizes[n] for n in sizes) / total, "global": cos(*tot)}
