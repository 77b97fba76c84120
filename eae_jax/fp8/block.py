"""Decoder blocks with fp8 seams, calibrated and gated layer by layer.

`bind_block` takes a (stacked) block's params and a few inputs of the
stack, runs the high-precision stack over them to see what every seam of
every layer really receives, calibrates the static scales per layer, and
gates each seam at the block boundary: the block's output with that one
seam in fp8 against the block's output in high precision (the residual is
inside the block, so this is the "incl. residual" boundary). The result is
a `BoundBlock`.

`BoundBlock.block_fn()` is a pure ``block(p, x)`` with
``p = {'params': <block params>, 'fp8': <seam states>}`` for one layer; a
stack scans it over ``{'params': stacked, 'fp8': bound.state}`` (states
carry the same leading depth axis). It plugs into `eae_jax.reconstruct`
unchanged::

    bound = bind_block(cfg, params, [x_calib])
    stack = eae_jax.reconstruct(bound.block_fn())
    p = bound.params(params)                      # {'params': ..., 'fp8': ...}

    def loss_fn(p, x):
        return jnp.mean(stack(p, x).astype(jnp.float32) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(p, x)
    state = bound.fold(p['fp8'], g['fp8'])        # ledger counts, detaching
    params = params - lr * g['params'] ...

The block is `eae_jax.blocks.decoder_block` with its ``ffn_fn`` and
``attention_fn`` overrides: the attention override is the same computation
as `eae_jax.blocks.causal_attention` with the projections routed through
the ``qkv`` and ``o`` seams (a test checks that the high-precision path
equals the plain block bit for bit).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.blocks.linear import linear
from eae_jax.blocks.attention import causal_attention
from eae_jax.blocks.transformer import BlockConfig, check_block_params, decoder_block
from eae_jax.fp8 import ledger as ledger_lib
from eae_jax.fp8 import seams as seams_lib
from eae_jax.fp8.quant import E4M3, WEIGHT_SCALINGS, scale_from_amax
from eae_jax.fp8.seams import GateRefused, Seam, SeamConfig, SeamState

SEAM_NAMES = ("qkv", "o", "ffn")


def block_seams(which: Sequence[str] = SEAM_NAMES, config: Optional[SeamConfig] = None,
                **config_fields) -> Dict[str, Seam]:
    """The seams of a decoder block: any of ``'qkv'``, ``'o'``, ``'ffn'``.

    Raises:
      ValueError: an unknown seam name.
    """
    unknown = [w for w in which if w not in SEAM_NAMES]
    if unknown:
        raise ValueError(f"unknown block seam(s) {unknown}; expected a subset of {SEAM_NAMES}")
    makers = {"qkv": seams_lib.qkv_seam, "o": seams_lib.out_proj_seam, "ffn": seams_lib.ffn_seam}
    return {w: makers[w](w, config, **config_fields) for w in SEAM_NAMES if w in which}


def policy_seams(policy: Any, which: Sequence[str] = SEAM_NAMES, **config_fields) -> Dict[str, Seam]:
    """The block seams a `eae_jax.DTypePolicy` asks for.

    A policy without ``fp8_format`` (fp32/bf16/fp16) asks for none (an empty
    dict: every region stays in the compute dtype). ``fp8_e4m3`` gives
    `block_seams` (e4m3 forward, e5m2 gradients).

    Raises:
      ValueError: ``fp8_format`` is e5m2: the forward GEMMs need e4m3
        operands (cuBLASLt has no e5m2 x e5m2 GEMM; e5m2 is the gradient
        format, used by every seam's backward).
    """
    fmt = getattr(policy, "fp8_format", None)
    if fmt is None:
        return {}
    if jnp.dtype(fmt) != E4M3:
        raise ValueError(f"fp8 seams compute their forward in float8_e4m3fn, got a policy with fp8_format={fmt}; "
                         "use DTypePolicy.from_name('fp8_e4m3') (gradients run in e5m2 either way)")
    return block_seams(which, **config_fields)


def _cast_params(cfg: BlockConfig, params):
    """The plain block's compute-dtype cast of its (float) params."""
    if cfg.compute_dtype is None:
        return params
    return jax.tree_util.tree_map(
        lambda p: p.astype(cfg.compute_dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def _cast(cfg: BlockConfig, params, x):
    """The plain block's compute-dtype cast (params and input)."""
    if cfg.compute_dtype is None:
        return params, x
    return _cast_params(cfg, params), x.astype(cfg.compute_dtype)


def _hp(name: str, sub: dict, h: jax.Array):
    """High-precision result of a block region, split like the seam's output."""
    if name == "ffn":
        from eae_jax.blocks.swiglu import swiglu

        return swiglu(sub, h)
    if name == "qkv":
        return linear(h, sub["wq"]), linear(h, sub["wk"]), linear(h, sub["wv"])
    return linear(h, sub["wo"])


def _inner_block(cfg: BlockConfig, runner: Callable) -> Callable:
    """`decoder_block` (without its cast) whose FFN and projections call ``runner(name, params, h)``."""
    cfg_nocast = dataclasses.replace(cfg, compute_dtype=None)

    def ffn_fn(p, h):
        return runner("ffn", p, h)

    def attention_fn(p, h, **kwargs):
        # eae_jax.blocks.causal_attention with the projections routed through the seams.
        return causal_attention(p, h, project_qkv=lambda pp, x: runner("qkv", pp, x),
                                project_out=lambda pp, o: runner("o", pp, o), **kwargs)

    return decoder_block(cfg_nocast, ffn_fn=ffn_fn, attention_fn=attention_fn)


def _check_p(p, seams):
    if not isinstance(p, dict) or set(p) != {"params", "fp8"}:
        raise ValueError("an fp8 block takes p = {'params': <block params>, 'fp8': <seam states>}, got "
                         f"{type(p).__name__} with keys {sorted(p) if isinstance(p, dict) else None}")
    missing = [n for n in seams if n not in p["fp8"]]
    if missing:
        raise ValueError(f"fp8 block: no state for seam(s) {missing} (have {sorted(p['fp8'])})")


FALLBACKS = ("seam", "block", "step")


def _check_fallback(fallback: str) -> str:
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown fallback granularity {fallback!r}; expected one of {FALLBACKS}")
    return fallback


def _run(cfg: BlockConfig, seams: Dict[str, Seam], states, params, x, monitor, fallback: str):
    """The block on cast ``(params, x)``: ``(y, {seam name: ledger increments})``.

    ``fallback='seam'``: each seam call decides (one ``lax.cond`` per seam).
    ``fallback='block'``: every seam attempts fp8; one ``lax.cond`` per block
    call replaces the whole block's output by the high-precision block when
    any seam's check failed. The seams that did not fail are then counted as
    fallbacks with reason ``'block'``.
    """
    if fallback == "seam":
        incs = {}

        def runner(name, sub, h):
            if name in seams:
                y, incs[name] = seams_lib.apply_with_ledger(seams[name], states[name], sub, h, monitor)
                return y
            return _hp(name, sub, h)

        y = _inner_block(cfg, runner)(params, x)
        return y, dict(incs)

    if fallback == "step" or not any(seams_lib.can_fall_back(sm) for sm in seams.values()):
        # 'step': no decision here; the train step decides from the counts
        # (BoundBlock.fold_step) and reruns itself in high precision.
        y, (_, incs) = _block_attempt(cfg, seams, states, params, x, monitor, own_codes=fallback == "step")
        return y, incs
    # One decision per block call, kept for the backward (seams_lib.decide_once).
    return seams_lib.decide_once(lambda p, h, st: _block_attempt(cfg, seams, st, p, h, monitor),
                                 _inner_block(cfg, _hp))(params, x, states)


def _block_attempt(cfg: BlockConfig, seams: Dict[str, Seam], states, params, x, monitor, own_codes: bool = False):
    """Every seam attempts fp8: ``(y8, (bad, increments))``; ``bad`` says
    whether any seam's check failed (the increments then count the others
    with reason ``'block'``, unless ``own_codes``: each seam's own outcome)."""
    attempts = {}

    def runner(name, sub, h):
        if name in seams:
            attempts[name] = a = seams_lib.attempt(seams[name], states[name], sub, h, monitor)
            return seams_lib.split_output(seams[name], sub, a.y)
        return _hp(name, sub, h)

    y8 = _inner_block(cfg, runner)(params, x)
    own = [a.code >= 0 for n, a in attempts.items()
           if a.trace_reason is None and seams_lib.can_fall_back(seams[n])]
    bad = functools.reduce(jnp.logical_or, own, jnp.zeros((), jnp.bool_))
    block_code = jnp.where(bad, ledger_lib.BLOCK_REASON, -1).astype(jnp.int32)
    incs = {}
    for n, a in attempts.items():
        if a.trace_reason is not None or own_codes:
            incs[n] = seams_lib.attempt_increments(a)
        else:
            incs[n] = seams_lib.attempt_increments(a, jnp.where(a.code >= 0, a.code, block_code))
    return y8, (bad, incs)


def fp8_block(cfg: BlockConfig, seams: Dict[str, Seam], monitor=None, fallback: str = "block") -> Callable:
    """The pure block ``block(p, x)`` with fp8 seams, counted through the VJP.

    Args:
      cfg: the block configuration (its ``compute_dtype`` casts params and
        input as in `decoder_block`; seam states are never cast).
      seams: from `block_seams` (regions not listed run in high precision).
      monitor: `LedgerMonitor` for trace-time warnings.
      fallback: where a failed value check sends the computation back to
        high precision. ``'seam'``: that seam call only (one ``lax.cond``
        per seam call). ``'block'``: the whole block call (one ``lax.cond``
        per block call; the other seams' calls count as fallbacks with
        reason ``'block'``, which neither extends their run of consecutive
        fallbacks nor detaches them). A cond is a branch point XLA cannot
        fuse across (its operands and results are materialised); in a
        reconstruct train step each decision costs one cond forward and one
        backward, and the recomputation decides again only where a seam's
        output feeds the rest of the block
        (`eae_jax.fp8.seams.decide_once`): the three block seams take 8
        conds per layer with ``'seam'`` and 2 with ``'block'``.
        A detached seam makes every call of its block fall back under
        ``'block'``: rebind without it to keep the others in fp8.
        ``'step'``: no decision in the block at all (no cond): every seam
        runs fp8 and counts its own outcome; the train step decides once
        (`BoundBlock.fold_step`): when any seam call of the step failed its
        check, the step's update is dropped and the step rerun in high
        precision (``eae-jax train --fp8-fallback step``). The cheapest
        guard, for training loops that can rerun a step.
        Default ``'block'`` (no rerun needed): on the H200 a medium
        reconstruct train step took 87.4 ms with it, 95.3 ms per seam and
        83.7 ms with no value checks; in another run 82.4 ms with
        ``'step'`` against 82.2 ms unchecked (`experiments/bench_fp8.py
        --e2e`; README).

    Returns:
      ``block(p, x) -> (batch, seq, dim)`` with ``p = {'params', 'fp8'}``.

    Raises:
      ValueError: an unknown ``fallback``.
    """
    _check_fallback(fallback)

    def block(p, x):
        _check_p(p, seams)
        params, x = _cast(cfg, p["params"], x)
        states = p["fp8"]
        y, incs = _run(cfg, seams, states, params, x, monitor, fallback)
        for n in seams:
            y = ledger_lib.count(y, states[n].ledger, incs[n])
        return y

    block.__name__ = f"fp8_block_{'_'.join(seams) or 'none'}"
    return block


def fp8_block_with_ledger(cfg: BlockConfig, seams: Dict[str, Seam], monitor=None, fallback: str = "block") -> Callable:
    """Like `fp8_block` but ``block(p, x) -> (y, increments)`` (a dict of
    `Ledger` increments per seam) for inference without a VJP."""
    _check_fallback(fallback)

    def block(p, x):
        _check_p(p, seams)
        params, x = _cast(cfg, p["params"], x)
        return _run(cfg, seams, p["fp8"], params, x, monitor, fallback)

    return block


def _raw_runner(seams, scales, fp8_names=()):
    """Runner for calibration: fp8 (unguarded) for ``fp8_names``, else high precision."""

    def runner(name, sub, h):
        if name in fp8_names:
            return seams_lib.split_output(seams[name], sub, seams_lib.fp8_forward(seams[name], sub, h, scales[name]))
        return _hp(name, sub, h)

    return runner


@dataclasses.dataclass(frozen=True)
class BoundBlock:
    """A decoder block with bound fp8 seams.

    Attributes:
      cfg: the block configuration.
      seams: name -> `Seam`.
      state: name -> `SeamState` with a leading depth axis (one per layer).
      certification: name -> dict (dims, per-layer scales, worst boundary
        and bare cosines per layer, samples, percentile, gate).
      monitor: host-side `LedgerMonitor`.
      fallback: ``'seam'``, ``'block'`` or ``'step'`` (see `fp8_block`).
    """

    cfg: BlockConfig
    seams: Dict[str, Seam]
    state: Dict[str, SeamState]
    certification: Dict[str, dict]
    monitor: ledger_lib.LedgerMonitor = dataclasses.field(default_factory=ledger_lib.LedgerMonitor, compare=False)
    fallback: str = "block"

    def __post_init__(self):
        _check_fallback(self.fallback)

    def block_fn(self) -> Callable:
        """`fp8_block` for these seams (counts through the VJP)."""
        return fp8_block(self.cfg, self.seams, self.monitor, self.fallback)

    def block_fn_with_ledger(self) -> Callable:
        """`fp8_block_with_ledger` for these seams."""
        return fp8_block_with_ledger(self.cfg, self.seams, self.monitor, self.fallback)

    def with_fallback(self, fallback: str) -> "BoundBlock":
        """The same bound block deciding fallbacks per ``'seam'`` call, per
        ``'block'`` call or per train ``'step'`` (see `fp8_block`)."""
        return dataclasses.replace(self, fallback=_check_fallback(fallback))

    def params(self, block_params: Any, state: Optional[Dict[str, SeamState]] = None) -> dict:
        """``{'params': block_params, 'fp8': state (default: the bound one)}``."""
        return {"params": block_params, "fp8": self.state if state is None else state}

    def fold(self, state: Dict[str, SeamState], grads: Dict[str, Any], notify: bool = True) -> Dict[str, SeamState]:
        """New seam states after one step.

        Args:
          state: the states used in the step.
          grads: their cotangent (``grads['fp8']`` of a step differentiated
            with respect to ``p``) or summed forward increments (a dict of
            `Ledger` per seam).
          notify: one host callback: warnings once per seam and reason, and
            once when a seam detaches.
        """
        new = {n: seams_lib.fold_state(self.seams[n], state[n], grads[n]) for n in self.seams}
        if notify:
            self.monitor.notify({n: s.ledger for n, s in new.items()})
        return new

    def report(self, state: Dict[str, SeamState]) -> List[Dict[str, Any]]:
        """Per seam and layer (``ffn[3]`` = layer 3's FFN): calls, fp8 calls,
        fallbacks by reason, last reason, consecutive, detached."""
        out = []
        for n in self.seams:
            out.extend(seams_lib.state_report(state[n], n))
        return out

    def with_grad_scaling(self, grad_scaling: str) -> "BoundBlock":
        """The same bound block with every seam's gradient scaling set to
        ``'current'`` or ``'delayed'`` (see `eae_jax.fp8.SeamConfig`). A
        train loop runs its first step with ``'current'`` (which records the
        gradient amax), folds it, then switches to ``'delayed'``."""
        if grad_scaling not in seams_lib.GRAD_SCALINGS:
            raise ValueError(f"unknown grad_scaling {grad_scaling!r}; expected one of {seams_lib.GRAD_SCALINGS}")
        return dataclasses.replace(self, seams={n: sm.replace(grad_scaling=grad_scaling)
                                                for n, sm in self.seams.items()})

    def with_weight_scaling(self, weight_scaling: str, params: Any = None) -> "BoundBlock":
        """The same bound block (scales, gate, certification) with every seam's
        weight scaling set to ``'channel'``, ``'tensor'`` or ``'delayed'``
        (see `eae_jax.fp8.SeamConfig`). Switching to ``'delayed'`` starts each
        layer's weight scales from ``params`` (the block params, stacked for
        several layers) unless the state has them; switching away drops them.

        Raises:
          ValueError: an unknown name, or ``'delayed'`` without weight scales
            in the state and no ``params``.
        """
        if weight_scaling not in WEIGHT_SCALINGS:
            raise ValueError(f"unknown weight_scaling {weight_scaling!r}; expected one of {WEIGHT_SCALINGS}")
        seams = {n: sm.replace(weight_scaling=weight_scaling) for n, sm in self.seams.items()}
        state = {}
        for n, st in self.state.items():
            if weight_scaling != "delayed":
                state[n] = st._replace(weight_scales=None, weight_clipped=None)
                continue
            if st.weight_scales is not None:
                state[n] = st
                continue
            if params is None:
                raise ValueError(f"seam {n!r}: delayed weight scaling starts from the weights' scales; pass params")
            stacked = _as_stacked(self.cfg, params)
            w_scales = jax.vmap(functools.partial(seams_lib.weight_scales_of, seams[n]))(
                stacked["ffn" if n == "ffn" else "attn"])
            if w_scales.shape[0] != st.scales.shape[0]:
                raise ValueError(f"seam {n!r}: params have {w_scales.shape[0]} layer(s), the state "
                                 f"{st.scales.shape[0]}")
            state[n] = st._replace(weight_scales=w_scales, weight_clipped=jnp.zeros_like(w_scales))
        return dataclasses.replace(self, seams=seams, state=state)

    def cast_weights(self, state: Dict[str, SeamState], block_params: Any) -> Dict[str, SeamState]:
        """``state`` with every delayed-weight seam's weights cast to e4m3
        once, every layer (`eae_jax.fp8.cast_weights`), from ``block_params``
        (stacked like the state, or one block for a depth-1 state) in the
        block's compute dtype, as the block's calls would quantize them.

        A reconstruct train step runs every block twice (forward and
        recomputation): casting at the start of the step quantizes each
        weight once instead of twice, with the same results bit for bit.
        Seams with other weight scalings keep their state. Cast again for
        every step (``fold`` drops the bytes).

        Raises:
          ValueError: params that do not fit the block or the state's depth,
            a delayed-weight state without weight scales.
        """
        stacked = _as_stacked(self.cfg, block_params)
        out = dict(state)
        for n, seam in self.seams.items():
            if seam.config.weight_scaling != "delayed":
                continue
            st = state[n]
            sub = stacked["ffn" if n == "ffn" else "attn"]
            depth = jax.tree_util.tree_leaves(sub)[0].shape[0]
            if st.scales.shape[0] != depth:
                raise ValueError(f"seam {n!r}: params have {depth} layer(s), the state {st.scales.shape[0]}")
            out[n] = jax.vmap(functools.partial(seams_lib.cast_weights, seam))(st, _cast_params(self.cfg, sub))
        return out

    def fold_step(self, state: Dict[str, SeamState], grads: Dict[str, Any],
                  notify: bool = True):
        """`fold` for ``fallback='step'``: ``(new state, bad)``.

        ``bad`` (bool scalar) says whether any seam call of the step failed a
        check (any seam, any layer): the caller drops the step's update and
        reruns it in high precision. The counts then say so: the failing
        calls with their own reason, every other call of the step with
        reason ``'step'``; gradient-scale observations of a dropped step are
        discarded, and so are its weight-amax observations.
        """
        ledgers = {n: (g.ledger if isinstance(g, SeamState) else g) for n, g in grads.items()}
        bad = functools.reduce(jnp.logical_or, [jnp.any(ledger_lib.own_fallbacks(ledgers[n]) > 0)
                                                for n in self.seams], jnp.zeros((), jnp.bool_))
        adjusted = {}
        for n in self.seams:
            g = grads[n]
            led = ledger_lib.as_step_fallback(ledgers[n], bad)
            if isinstance(g, SeamState):
                def drop(obs):
                    return None if obs is None else jnp.where(bad, jnp.zeros_like(obs), obs)
                adjusted[n] = g._replace(ledger=led, grad_scales=drop(g.grad_scales),
                                         weight_scales=drop(g.weight_scales), weight_cast=None)
            else:
                adjusted[n] = led
        return self.fold(state, adjusted, notify), bad

    def require_grad_scales(self, state: Dict[str, SeamState]) -> None:
        """Raise ValueError unless every seam and layer of ``state`` has
        observed gradient scales (what ``'delayed'`` gradient scaling needs)."""
        for n in self.seams:
            seams_lib.require_grad_scales(self.seams[n], state[n])


def _depth_of(cfg: BlockConfig, params) -> Optional[int]:
    scale = params["attn_norm"]["scale"]
    if scale.ndim == 1:
        check_block_params(params, cfg)
        return None
    depth = int(scale.shape[0])
    check_block_params(params, cfg, leading=(depth,), where="stacked block")
    return depth


def _as_stacked(cfg: BlockConfig, params):
    """Block params with a leading depth axis (one block gets depth 1)."""
    return params if _depth_of(cfg, params) is not None else jax.tree_util.tree_map(lambda a: a[None], params)


def _resolve_seams(seams) -> Dict[str, Seam]:
    """`bind_block`'s ``seams``: None (all), names, or a name -> `Seam` dict."""
    if seams is None:
        return block_seams()
    if isinstance(seams, str):
        return block_seams((seams,))
    if not isinstance(seams, Mapping):
        names = list(seams)
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"seams must be seam names or a dict name -> Seam, got {seams!r}")
        return block_seams(names)
    unknown = [n for n in seams if n not in SEAM_NAMES]
    if unknown:
        raise ValueError(f"unknown block seam(s) {unknown}; expected a subset of {SEAM_NAMES}")
    bad = [n for n, v in seams.items() if not isinstance(v, Seam)]
    if bad:
        raise ValueError(f"seams {bad} are not Seam objects (make them with block_seams / ffn_seam ...)")
    return dict(seams)


def bind_block(
    cfg: BlockConfig,
    params: Any,
    calibration_inputs: Sequence[jax.Array],
    seams: Union[None, str, Sequence[str], Dict[str, Seam]] = None,
    *,
    percentile: float = 99.9,
    gate_cos: Optional[float] = None,
    scales: Optional[Dict[str, Any]] = None,
    fallback: str = "block",
) -> BoundBlock:
    """Calibrate and gate fp8 seams for every layer of a (stacked) block.

    Args:
      cfg: the block configuration.
      params: one block's params or a stack (leading depth axis).
      calibration_inputs: inputs of the first block, ``(batch, seq, dim)``
        each (one array or a list). Layer i is calibrated on what the
        high-precision stack feeds it.
      seams: from `block_seams`, or seam names (default: qkv, o and ffn
        with default config).
      percentile: per-sample amax reduced across samples at this percentile.
      gate_cos: threshold (default each seam's ``config.gate_cos``; 0 off).
      scales: override per seam name, ``(depth, points)`` (or ``(points,)``).
      fallback: ``'seam'``, ``'block'`` or ``'step'``: how the bound block falls back
        (see `fp8_block`).

    Returns:
      A `BoundBlock` whose ``state`` has a leading depth axis (depth 1 for
      unstacked params; use ``jax.tree_util.tree_map(lambda a: a[0], ...)``
      for a single block).

    Raises:
      ValueError: bad params/inputs.
      GateRefused: a seam misses the gate at some layer (all failures listed).
    """
    _check_fallback(fallback)
    seams = _resolve_seams(seams)
    depth = _depth_of(cfg, params)
    stacked = params if depth is not None else jax.tree_util.tree_map(lambda a: a[None], params)
    depth = depth or 1
    samples = seams_lib._as_list(calibration_inputs)
    if not samples:
        raise ValueError("bind_block needs at least one calibration input")
    for i, s in enumerate(samples):
        if s.ndim != 3 or s.shape[-1] != cfg.dim:
            raise ValueError(f"calibration input {i} has shape {s.shape}; expected (batch, seq, {cfg.dim})")
    if cfg.compute_dtype is not None:
        # The stack's boundaries are in the compute dtype; so is what layer i sees.
        samples = [s.astype(cfg.compute_dtype) for s in samples]
    names = list(seams)

    def hp_block(p, x, runner):
        p, x = _cast(cfg, p, x)
        return _inner_block(cfg, runner)(p, x)

    @jax.jit
    def pass_amax(stacked, x):
        def body(h, p):
            amax = {}

            def runner(name, sub, hh):
                if name in seams:
                    amax[name] = seams_lib.amax_points(seams[name], sub, hh)
                return _hp(name, sub, hh)

            y = hp_block(p, h, runner)
            return y, dict(amax)

        return jax.lax.scan(body, x, stacked)[1]

    per_sample = [jax.tree_util.tree_map(np.asarray, pass_amax(stacked, s)) for s in samples]
    reduced = {n: seams_lib.reduce_amax(np.stack([a[n] for a in per_sample]), percentile) for n in names}
    calibrated = {n: np.asarray(scale_from_amax(jnp.asarray(reduced[n]), E4M3, seams[n].config.margin))
                  for n in names}
    used = dict(calibrated)
    for n, s in (scales or {}).items():
        if n not in seams:
            raise ValueError(f"scales given for unknown seam {n!r}; seams are {names}")
        s = np.broadcast_to(np.asarray(s, np.float32), (depth, seams[n].points))
        used[n] = np.array(s)

    @jax.jit
    def pass_gate(stacked, x, used):
        def body(h, xs):
            p, sc = xs
            bare = {}

            def tap_runner(name, sub, hh):
                if name in seams:
                    y8 = seams_lib.fp8_forward(seams[name], sub, hh, sc[name])
                    bare[name] = seams_lib.cosine(y8, seams_lib.high_precision(seams[name], sub, hh))
                return _hp(name, sub, hh)

            y_hp = hp_block(p, h, tap_runner)
            boundary = {n: seams_lib.cosine(hp_block(p, h, _raw_runner(seams, sc, (n,))), y_hp) for n in names}
            all_fp8 = seams_lib.cosine(hp_block(p, h, _raw_runner(seams, sc, tuple(names))), y_hp)
            return y_hp, (boundary, dict(bare), all_fp8)

        return jax.lax.scan(body, x, (stacked, used))[1]

    used_j = {n: jnp.asarray(v) for n, v in used.items()}
    gates = [jax.tree_util.tree_map(np.asarray, pass_gate(stacked, s, used_j)) for s in samples]
    boundary = {n: np.stack([g[0][n] for g in gates]).min(axis=0) for n in names}
    bare = {n: np.stack([g[1][n] for g in gates]).min(axis=0) for n in names}
    all_fp8 = np.stack([g[2] for g in gates]).min(axis=0)

    failures = []
    for n in names:
        thr = seams[n].config.gate_cos if gate_cos is None else float(gate_cos)
        for layer in range(depth):
            c = float(boundary[n][layer])
            if thr and not c >= thr:
                failures.append((n, layer, c, thr))
    if failures:
        worst = min(f[2] for f in failures)
        listing = ", ".join(f"{n} at layer {l}: {c:.6f} < {t}" for n, l, c, t in failures)
        raise GateRefused(
            f"eae_jax.fp8: block seams refused at the block boundary (incl. residual) on {len(samples)} "
            f"calibration sample(s): {listing}", worst)

    cert, state = {}, {}
    for n in names:
        seam = seams[n]
        dims = seams_lib.seam_dims(seam, jax.tree_util.tree_map(lambda a: a[0], stacked)[
            "ffn" if n == "ffn" else "attn"])
        cert[n] = {
            "seam": n, "kind": seam.kind, "dims": dims, "depth": depth,
            "scales": used[n].tolist(), "calibrated_scales": calibrated[n].tolist(), "amax": reduced[n].tolist(),
            "percentile": float(percentile), "samples": len(samples),
            "rows": [int(np.prod(s.shape[:-1])) for s in samples],
            "worst_cos": float(boundary[n].min()), "worst_cos_per_layer": boundary[n].tolist(),
            "bare_cos_per_layer": bare[n].tolist(), "all_fp8_block_cos_per_layer": all_fp8.tolist(),
            "gate_cos": seam.config.gate_cos if gate_cos is None else float(gate_cos),
            "gate_boundary": "block boundary (incl. residual)", "act_scaling": seam.config.act_scaling,
        }
        state[n] = _layer_states(seam, depth, used[n], stacked["ffn" if n == "ffn" else "attn"])
    return BoundBlock(cfg, seams, state, cert, fallback=fallback)


def init_block_state(seams: Dict[str, Seam], depth: int, scales: Optional[Dict[str, Any]] = None,
                     params: Any = None) -> Dict[str, SeamState]:
    """Seam states for ``depth`` layers without calibration (scales default 1;
    for tests and for restoring saved scales).

    Args:
      params: the stacked block params (leading ``depth`` axis); needed by
        seams with ``weight_scaling='delayed'``, whose states start from the
        weights' per-tensor scales.

    Raises:
      ValueError: a delayed-weight seam and no ``params``.
    """
    out = {}
    for n, seam in seams.items():
        s = np.ones((depth, seam.points), np.float32) if not scales or n not in scales else \
            np.broadcast_to(np.asarray(scales[n], np.float32), (depth, seam.points))
        sub = None if params is None else params["ffn" if n == "ffn" else "attn"]
        out[n] = _layer_states(seam, depth, s, sub)
    return out


def _layer_states(seam: Seam, depth: int, scales, stacked_params: Any = None) -> SeamState:
    """A seam's state for ``depth`` layers with ``(depth, points)`` activation
    scales, a zeroed ledger, unobserved gradient scales and (delayed weight
    scaling) each layer's weight scales from ``stacked_params``."""
    delayed_w = seam.config.weight_scaling == "delayed"
    if delayed_w and stacked_params is None:
        raise ValueError(f"seam {seam.name!r} has weight_scaling='delayed': its state starts from the weights' "
                         "scales; pass the stacked block params")
    one = seams_lib.init_state(seam.replace(weight_scaling="channel"))
    stacked = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (depth,) + a.shape), one)
    stacked = stacked._replace(scales=jnp.asarray(scales, jnp.float32))
    if not delayed_w:
        return stacked
    w_scales = jax.vmap(functools.partial(seams_lib.weight_scales_of, seam))(stacked_params)
    return stacked._replace(weight_scales=w_scales, weight_clipped=jnp.zeros_like(w_scales))
