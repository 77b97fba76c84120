"""Decoder blocks with fp8 seams (`eae_jax.fp8.bind_block` binds them).

``block(p, x)``, ``p = {'params', 'fp8'}``, is `eae_jax.blocks.decoder_block`
with its FFN and projections routed through the seams (its high-precision
path is the plain block bit for bit). Fallback: ``'block'`` (one
``lax.cond`` per block call) or ``'step'`` (the train step decides).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.blocks.attention import causal_attention
from eae_jax.blocks.linear import linear
from eae_jax.blocks.swiglu import swiglu
from eae_jax.blocks.transformer import BlockConfig, check_block_params, decoder_block
from eae_jax.fp8 import seams as sl
from eae_jax.fp8 import state as st
from eae_jax.fp8.quant import E4M3
from eae_jax.fp8.state import SeamState

SEAM_NAMES = ("qkv", "o", "ffn")
FALLBACKS = ("block", "step")
_PARAMS_OF = {"qkv": "attn", "o": "attn", "ffn": "ffn"}


def block_seams(which: Sequence[str] = SEAM_NAMES, **fields) -> Dict[str, sl.Seam]:
    """The seams of a decoder block (of ``'qkv'``, ``'o'``, ``'ffn'``), ``fields``
    setting recipe / guard / contract fields of each.

    >>> list(block_seams(("ffn", "qkv"), weight="delayed"))
    ['qkv', 'ffn']
    """
    unknown = [w for w in which if w not in SEAM_NAMES]
    if unknown:
        raise ValueError(f"unknown block seam(s) {unknown}; expected a subset of {SEAM_NAMES}")
    makers = {"qkv": sl.qkv_seam, "o": sl.out_proj_seam, "ffn": sl.ffn_seam}
    return {w: makers[w](w, **fields) for w in SEAM_NAMES if w in which}


def policy_seams(policy: Any, which: Sequence[str] = SEAM_NAMES, **fields) -> Dict[str, sl.Seam]:
    """The block seams a `eae_jax.DTypePolicy` asks for: none without an
    ``fp8_format``, `block_seams` for e4m3 (ValueError for e5m2: the forward
    needs e4m3 operands; e5m2 is the gradients' format).

    >>> import eae_jax
    >>> policy_seams(eae_jax.DTypePolicy.from_name("bf16"))
    {}
    """
    fmt = getattr(policy, "fp8_format", None)
    if fmt is None:
        return {}
    if jnp.dtype(fmt) != E4M3:
        raise ValueError(f"fp8 seams compute their forward in float8_e4m3fn, got a policy with fp8_format={fmt}; "
                         "use DTypePolicy.from_name('fp8_e4m3') (gradients run in e5m2 either way)")
    return block_seams(which, **fields)


def _cast(cfg: BlockConfig, tree):
    """The plain block's compute-dtype cast of float leaves."""
    if cfg.compute_dtype is None:
        return tree
    return jax.tree_util.tree_map(
        lambda a: a.astype(cfg.compute_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _hp(name: str, sub: dict, h: jax.Array):
    """High-precision result of a block region, split like the seam's output."""
    if name == "ffn":
        return swiglu(sub, h)
    if name == "qkv":
        return linear(h, sub["wq"]), linear(h, sub["wk"]), linear(h, sub["wv"])
    return linear(h, sub["wo"])


def _inner_block(cfg: BlockConfig, runner: Callable) -> Callable:
    """`decoder_block` (without its cast) whose FFN and projections call ``runner(name, params, h)``."""
    def attention_fn(p, h, **kwargs):
        return causal_attention(p, h, project_qkv=lambda pp, x: runner("qkv", pp, x),
                                project_out=lambda pp, o: runner("o", pp, o), **kwargs)

    return decoder_block(dataclasses.replace(cfg, compute_dtype=None), ffn_fn=lambda p, h: runner("ffn", p, h),
                         attention_fn=attention_fn)


def _check_fallback(fallback: str) -> str:
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown fallback granularity {fallback!r}; expected one of {FALLBACKS}")
    return fallback


def _attempt(cfg, seams, states, params, x, monitor, own_codes):
    """Every seam attempts fp8: ``(y8, (bad, {name: (counts, amax)}))``; ``bad``
    says whether any seam's check failed (the others are then counted with
    reason ``'block'``, unless ``own_codes``: each seam its own outcome)."""
    attempts = {}

    def runner(name, sub, h):
        if name not in seams:
            return _hp(name, sub, h)
        attempts[name] = a = sl._attempt(seams[name], states[name], sub, h, monitor)
        return sl._split_output(seams[name], sub, a.y)

    y8 = _inner_block(cfg, runner)(params, x)
    checked = [n for n, a in attempts.items() if a.trace_reason is None and sl._can_fall_back(seams[n])]
    bad = functools.reduce(jnp.logical_or, [attempts[n].code >= 0 for n in checked], jnp.zeros((), jnp.bool_))
    block_code = jnp.where(bad, st.reason_index("block"), -1)
    aux = {}
    for n, a in attempts.items():
        code = a.code if own_codes or n not in checked else jnp.where(a.code >= 0, a.code, block_code)
        aux[n] = (st._call_counts(code), a.amax)
    return y8, (bad if checked and not own_codes else None, aux)


def _run(cfg, seams, params, x, states, monitor, fallback):
    params, x = _cast(cfg, params), x.astype(cfg.compute_dtype) if cfg.compute_dtype is not None else x
    attempt_fn = functools.partial(_attempt, cfg, seams, monitor=monitor, own_codes=fallback == "step")
    if fallback == "step" or not any(sl._can_fall_back(s) for s in seams.values()):
        y, (_, aux) = attempt_fn(states, params, x)
        return y, aux
    return sl._decide_once(lambda p, h, s: attempt_fn(s, p, h), _inner_block(cfg, _hp))(params, x, states)


def _check_p(p, seams):
    if not isinstance(p, dict) or set(p) != {"params", "fp8"}:
        raise ValueError("an fp8 block takes p = {'params': <block params>, 'fp8': <seam states>}, got "
                         f"{type(p).__name__} with keys {sorted(p) if isinstance(p, dict) else None}")
    missing = [n for n in seams if n not in p["fp8"]]
    if missing:
        raise ValueError(f"fp8 block: no state for seam(s) {missing} (have {sorted(p['fp8'])})")


def fp8_block(cfg: BlockConfig, seams: Dict[str, sl.Seam], monitor=None, fallback: str = "block") -> Callable:
    """The pure ``block(p, x)`` (``p = {'params', 'fp8'}``) reporting through the
    states' handles (differentiate with respect to ``p['fp8']``, then fold);
    ``fallback`` ``'block'`` or ``'step'``; regions without a seam run high precision.

    >>> from eae_jax.blocks import BlockConfig
    >>> fp8_block(BlockConfig(dim=8, num_heads=2, num_kv_heads=1, ffn_hidden_dim=16), {}).__name__
    'fp8_block_none'
    """
    _check_fallback(fallback)

    def block(p, x):
        _check_p(p, seams)
        y, aux = _run(cfg, seams, p["params"], x, p["fp8"], monitor, fallback)
        for n in seams:
            y = sl._report_call(y, p["fp8"][n], aux[n])
        return y

    block.__name__ = f"fp8_block_{'_'.join(seams) or 'none'}"
    return block


def fp8_block_with_ledger(cfg: BlockConfig, seams: Dict[str, sl.Seam], monitor=None,
                          fallback: str = "block") -> Callable:
    """Like `fp8_block`, ``block(p, x) -> (y, {name: Observed})`` for inference without a VJP.

    >>> from eae_jax.blocks import BlockConfig
    >>> callable(fp8_block_with_ledger(BlockConfig(dim=8, num_heads=2, num_kv_heads=1, ffn_hidden_dim=16), {}))
    True
    """
    _check_fallback(fallback)

    def block(p, x):
        _check_p(p, seams)
        y, aux = _run(cfg, seams, p["params"], x, p["fp8"], monitor, fallback)
        return y, {n: sl._observed_of(p["fp8"][n], aux[n]) for n in seams}

    return block


def _depth_of(cfg: BlockConfig, params) -> Optional[int]:
    scale = params["attn_norm"]["scale"]
    if scale.ndim == 1:
        check_block_params(params, cfg)
        return None
    check_block_params(params, cfg, leading=(int(scale.shape[0]),), where="stacked block")
    return int(scale.shape[0])


def _as_stacked(cfg: BlockConfig, params):
    """Block params with a leading depth axis (one block gets depth 1)."""
    return params if _depth_of(cfg, params) is not None else jax.tree_util.tree_map(lambda a: a[None], params)


def _layer_states(seam: sl.Seam, depth: int, scales, stacked_params=None) -> SeamState:
    """A seam's state for ``depth`` layers, each leaf its own buffer; weight
    scales from ``stacked_params`` (required for delayed weights)."""
    if seam.recipe.weight == "delayed" and stacked_params is None:
        raise ValueError(f"seam {seam.name!r} has weight='delayed': its state starts from the weights' scales; "
                         "pass the stacked block params")
    ws = None if stacked_params is None else np.asarray(jax.vmap(functools.partial(sl.weight_scales_of, seam))(
        stacked_params))
    scales = np.broadcast_to(np.asarray(scales, np.float32), (depth, seam.points))
    layers = [st.new_state(seam.points, seam.gemms, scales[i], None if ws is None else ws[i]) for i in range(depth)]
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)


def init_block_state(seams: Dict[str, sl.Seam], depth: int, scales: Optional[Dict[str, Any]] = None,
                     params: Any = None) -> Dict[str, SeamState]:
    """Seam states for ``depth`` layers without calibration: scales 1 or
    ``scales[name]``; ``params`` (stacked) start the weight scales.

    >>> init_block_state(block_seams(("o",)), 3)["o"].scales.shape
    (3, 1)
    """
    return {n: _layer_states(s, depth, (scales or {}).get(n, 1.0), None if params is None else
                             params[_PARAMS_OF[n]]) for n, s in seams.items()}


@dataclasses.dataclass(frozen=True)
class BoundBlock:
    """A decoder block with bound seams: ``cfg``, ``seams`` (name -> `Seam`),
    ``state`` (name -> `SeamState`, depth axis first), ``certification`` (name
    -> dict of dims, per-layer scales and cosines, gate), a `LedgerMonitor`
    and the ``fallback``.

    >>> from eae_jax.blocks import BlockConfig
    >>> cfg, seams = BlockConfig(dim=8, num_heads=2, num_kv_heads=1, ffn_hidden_dim=16), block_seams(("o",))
    >>> b = BoundBlock(cfg, seams, init_block_state(seams, 2), {})
    >>> b.report(b.state)[1]["seam"]
    'o[1]'
    """

    cfg: BlockConfig
    seams: Dict[str, sl.Seam]
    state: Dict[str, SeamState]
    certification: Dict[str, dict]
    monitor: st.LedgerMonitor = dataclasses.field(default_factory=st.LedgerMonitor, compare=False)
    fallback: str = "block"

    def __post_init__(self):
        _check_fallback(self.fallback)

    def block_fn(self) -> Callable:
        """`fp8_block` of these seams."""
        return fp8_block(self.cfg, self.seams, self.monitor, self.fallback)

    def block_fn_with_ledger(self) -> Callable:
        """`fp8_block_with_ledger` of these seams."""
        return fp8_block_with_ledger(self.cfg, self.seams, self.monitor, self.fallback)

    def with_fallback(self, fallback: str) -> "BoundBlock":
        """The same bound block falling back per ``'block'`` call or per ``'step'``."""
        return dataclasses.replace(self, fallback=_check_fallback(fallback))

    def with_recipe(self, params: Any = None, **fields) -> "BoundBlock":
        """Every seam with recipe (or guard / contract) fields changed; delayed
        weights whose scales never started start from ``params``."""
        seams = {n: s.replace(**fields) for n, s in self.seams.items()}
        state = dict(self.state)
        for n, s in seams.items():
            if s.recipe.weight == "delayed" and not bool(jnp.all(state[n].weight_scales > 0)):
                if params is None:
                    raise ValueError(f"seam {n!r}: delayed weight scaling starts from the weights' scales; pass params")
                sub = _as_stacked(self.cfg, params)[_PARAMS_OF[n]]
                ws = jax.vmap(functools.partial(sl.weight_scales_of, s))(sub)
                if ws.shape != state[n].weight_scales.shape:
                    raise ValueError(f"seam {n!r}: params have {ws.shape[0]} layer(s), the state "
                                     f"{state[n].weight_scales.shape[0]}")
                state[n] = state[n]._replace(weight_scales=ws)
        return dataclasses.replace(self, seams=seams, state=state)

    def params(self, block_params: Any, state: Optional[Dict[str, SeamState]] = None) -> dict:
        """``{'params': block_params, 'fp8': state (default: the bound one)}``."""
        return {"params": block_params, "fp8": self.state if state is None else state}

    def fold(self, state: Dict[str, SeamState], cots: Dict[str, Any], notify: bool = True) -> Dict[str, SeamState]:
        """States after a step from their cotangents (``grads['fp8']``) or forward
        observations; ``notify``: one host callback to the monitor."""
        new = {n: sl.fold_state(s, state[n], cots[n]) for n, s in self.seams.items()}
        if notify:
            self.monitor.notify(new)
        return new

    def fold_step(self, state: Dict[str, SeamState], cots: Dict[str, Any], notify: bool = True):
        """`fold` for ``'step'``: ``(new state, bad)``, ``bad`` when a call of the
        step failed a check (the caller drops the update and reruns the step
        in high precision; the other calls count with reason ``'step'`` and the
        step's gradient and weight amaxes are dropped)."""
        seen = {n: st.observations(state[n], cots[n]) for n in self.seams}
        bad = functools.reduce(jnp.logical_or, [jnp.any(st.own_fallbacks(s) > 0) for s in seen.values()],
                               jnp.zeros((), jnp.bool_))
        new = {n: st.fold(s.recipe, s.guard.detach_after, state[n], st._as_step_fallback(seen[n], bad))
               for n, s in self.seams.items()}
        if notify:
            self.monitor.notify(new)
        return new, bad

    def report(self, state: Dict[str, SeamState]) -> List[Dict[str, Any]]:
        """Per seam and layer (``ffn[3]``: layer 3's FFN), `eae_jax.fp8.state.report`."""
        return [e for n in self.seams for e in st.report(state[n], n)]

    def require_grad_scales(self, state: Dict[str, SeamState]) -> None:
        """Raise ValueError unless every seam and layer has observed gradient
        scales (what delayed gradient scaling needs; host check)."""
        for n in self.seams:
            missing = np.argwhere(~(np.asarray(state[n].grad_scales) > 0))
            if missing.size:
                listing = ", ".join(str(tuple(int(i) for i in m)) for m in missing[:8])
                raise ValueError(f"seam {n!r}: gradient scales never observed at {listing}"
                                 f"{' ...' if len(missing) > 8 else ''} (index: layer, GEMM); run a step with "
                                 "gradient='current' and fold it first")

    def cast_weights(self, state: Dict[str, SeamState], block_params: Any) -> Dict[str, SeamState]:
        """``state`` with each delayed-weight seam's weights cast once per layer
        (`eae_jax.fp8.cast_weights`) from ``block_params`` in the compute dtype."""
        stacked, out = _as_stacked(self.cfg, block_params), dict(state)
        for n, seam in self.seams.items():
            if seam.recipe.weight != "delayed":
                continue
            sub = stacked[_PARAMS_OF[n]]
            depth = jax.tree_util.tree_leaves(sub)[0].shape[0]
            if state[n].scales.shape[0] != depth:
                raise ValueError(f"seam {n!r}: params have {depth} layer(s), the state {state[n].scales.shape[0]}")
            out[n] = jax.vmap(functools.partial(sl.cast_weights, seam))(state[n], _cast(self.cfg, sub))
        return out
