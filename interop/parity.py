"""Numerical parity between the torch reference and the JAX port.

A parity run feeds the same inputs and weights to both sides and reports,
per block boundary, the max abs error, the relative error
``||jax - torch|| / ||torch||`` and the cosine of:

(a) ``forward``: the boundaries x0..xL (plus, for a language model, the logits and
    the logits of the unmodified torch model's own forward);
(b) ``grad``: the gradient with respect to the stack's input x0 and every
    block's parameters (one row per block, all its tensors together; plus
    embedding, final norm and head of a language model): `eae_jax.reconstruct`
    (no passes) against torch autograd of the whole model;
(c) the adjoint at every boundary of `eae_jax.reconstruct` with eae_jax
    passes against ``eae_runtime.EAERuntime`` with the equivalent seed passes:

    =========== ======================================= ===================================
    pipeline    eae_jax                                 eae_runtime
    =========== ======================================= ===================================
    none        (none)                                  (none)
    int8_clip   int8_fake_quant(), clip_by_norm(1.0)    Int8QuantizationPass(), ClipPass(1.0)
    fp16        cast_roundtrip('fp16')                  FP16Pass()
    =========== ======================================= ===================================

    in three sections per pipeline:

    ``adjoint[p]``: end to end. Both backward passes run on their own, the
    adjoints are read after the passes at every boundary (a ``capture()``
    pass appended to the JAX chain, a recording pass appended to the seed
    pipeline), plus every block's parameter gradients.
    ``vjp[p]``: one block at a time. The JAX block VJP is fed the seed's own
    post-pass adjoint at x(i+1) and the seed's boundary x_i, and compared with
    the seed's pre-pass adjoint at x_i and block i's parameter gradients.
    ``pass[p]``: the JAX pass chain applied to the seed's pre-pass adjoint at
    each boundary, compared with the seed's post-pass adjoint.

Tolerances. Every row of (a), (b), ``vjp`` and ``pass`` must be within the
relative-error tolerance of the run's dtype (`TOLERANCES`: float32 1e-5,
bfloat16 2e-2). End-to-end rows of quantizing pipelines get a looser floor
(`END_TO_END_FLOOR`): a quantizer is discontinuous, so two correct
implementations whose inputs differ in the last bit round a few elements
to neighbouring grid points (one fp16 ulp, or max|g|/127 for int8), and those
differences feed every later block and its quantizer, growing with depth
(measured on stories260K: ~2e-2 for int8 at x0, ~4e-4 for fp16). The tight
``vjp`` and ``pass`` rows are where an implementation difference would show:
with identical inputs there is nothing to flip. The table prints each
row's tolerance.

The generic engine is `run_parity` on a `ParityCase`; `blocks_case`,
`seed_lm_case` and `hf_lm_case` build cases for reference-block stacks, whole
models on seed blocks (llama2.c), and ``transformers`` LLaMA models.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import eae_jax
from eae_jax import passes as jpasses
from eae_jax.blocks import decoder_block
from eae_jax.models import LMConfig, embed, head
from interop.layout import BlockLayout, HF_BLOCK, SEED_BLOCK
from interop.tensors import require_torch, torch_to_numpy

torch = require_torch()

#: Relative-error tolerance per compute dtype.
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2}
#: The pass pipelines compared in section (c).
PIPELINES = ("none", "int8_clip", "fp16")
#: Tolerance floor of the end-to-end rows of each pipeline (see the module doc).
END_TO_END_FLOOR = {"none": 0.0, "int8_clip": 5e-2, "fp16": 2.0 ** -9}


def jax_pipeline(name: str) -> list:
    """The eae_jax passes of a named pipeline (see the module table).

    Raises:
      ValueError: unknown name.
    """
    if name == "none":
        return []
    if name == "int8_clip":
        return [jpasses.int8_fake_quant(), jpasses.clip_by_norm(1.0)]
    if name == "fp16":
        return [jpasses.cast_roundtrip("fp16")]
    raise ValueError(f"unknown pipeline {name!r}; expected one of {PIPELINES}")


def torch_pipeline(name: str) -> list:
    """The eae_runtime passes of a named pipeline.

    Raises:
      ValueError: unknown name.
    """
    from eae_runtime.passes import ClipPass, FP16Pass, Int8QuantizationPass

    if name == "none":
        return []
    if name == "int8_clip":
        return [Int8QuantizationPass(), ClipPass(1.0)]
    if name == "fp16":
        return [FP16Pass()]
    raise ValueError(f"unknown pipeline {name!r}; expected one of {PIPELINES}")


# --------------------------------------------------------------------------- report
class Row(NamedTuple):
    """One comparison: ``section`` (forward / grad / adjoint[...]), ``name``
    (x3, block 2, dL/dx0 ...), the three metrics, the tolerance applied and
    whether the row passes."""

    section: str
    name: str
    max_abs: float
    rel: float
    cos: float
    tol: float
    ok: bool


def compare(got: Any, want: Any) -> tuple:
    """``(max_abs, rel, cos)`` of ``got`` against the reference ``want`` in float64.

    ``rel = ||got - want|| / ||want||`` (``||got||`` when want is zero);
    ``cos`` is 1 when both are zero. An empty comparison proves nothing:
    all three are NaN, so its row fails (never agreement by default).

    Raises:
      ValueError: shapes differ.
    """
    a = np.asarray(got, np.float64).ravel()
    b = np.asarray(want, np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {np.shape(got)} and {np.shape(want)}")
    if a.size == 0:
        return float("nan"), float("nan"), float("nan")
    diff = a - b
    nb, na = float(np.linalg.norm(b)), float(np.linalg.norm(a))
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    rel = float(np.linalg.norm(diff)) / nb if nb > 0 else float(np.linalg.norm(diff))
    if na == 0 and nb == 0:
        cos = 1.0
    elif na == 0 or nb == 0:
        cos = 0.0
    else:
        cos = float(np.dot(a, b) / (na * nb))
    return max_abs, rel, cos


@dataclasses.dataclass
class ParityReport:
    """The rows of one parity run plus what was run.

    Attributes:
      title: what was compared.
      dtype: the compute dtype name (selects the tolerance).
      rows: every comparison.
      info: extra facts (shapes, seeds, loss values ...).
    """

    title: str
    dtype: str
    rows: List[Row]
    info: Dict[str, Any]

    @property
    def ok(self) -> bool:
        """True when there are rows and every one is within its tolerance (a NaN row is not)."""
        return bool(self.rows) and all(r.ok for r in self.rows)

    @property
    def failures(self) -> List[Row]:
        return [r for r in self.rows if not r.ok]

    def worst(self, section_prefix: str = "") -> float:
        """Largest relative error among rows whose section starts with the prefix;
        NaN when one of them is NaN (a NaN never hides behind a finite maximum),
        0 when there are none."""
        rels = [r.rel for r in self.rows if r.section.startswith(section_prefix)]
        if any(np.isnan(r) for r in rels):
            return float("nan")
        return max(rels) if rels else 0.0

    def table(self) -> str:
        """A fixed-width text table, one line per row, with a verdict line."""
        head_ = f"{'section':<20} {'boundary/tensor':<18} {'max_abs_err':>12} {'rel_err':>12} {'cosine':>14} {'tol':>9}  ok"
        lines = [f"== parity: {self.title} ({self.dtype}) ==", head_, "-" * len(head_)]
        for r in self.rows:
            lines.append(f"{r.section:<20} {r.name:<18} {r.max_abs:>12.3e} {r.rel:>12.3e} {r.cos:>14.10f} "
                         f"{r.tol:>9.1e}  {'ok' if r.ok else 'FAIL'}")
        nan_rows = sum(1 for r in self.rows if np.isnan(r.rel))
        if self.ok:
            verdict = "PASS"
        elif not self.rows:
            verdict = "FAIL (nothing was compared)"
        else:
            verdict = (f"FAIL ({len(self.failures)} of {len(self.rows)} rows over tolerance"
                       + (f", {nan_rows} of them NaN" if nan_rows else "") + ")")
        lines.append(f"result: {verdict}; worst rel err: forward {self.worst('forward'):.3e}, "
                     f"grad {self.worst('grad'):.3e}, adjoint {self.worst('adjoint'):.3e}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready dict (rows as dicts)."""
        return {"title": self.title, "dtype": self.dtype, "ok": self.ok, "info": _jsonable(self.info),
                "rows": [r._asdict() for r in self.rows]}


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


# --------------------------------------------------------------------------- cases
class ParityCase(NamedTuple):
    """Everything `run_parity` needs: the same model on both sides.

    The model is ``loss = post(blocks(pre()))``: ``pre`` makes the stack's
    input x0 (an embedding lookup, or a fixed tensor), the blocks map x_i to
    x_(i+1), ``post`` turns xL into a scalar loss.

    Attributes:
      title: for the report.
      dtype: ``'float32'`` or ``'bfloat16'``.
      torch_blocks: single-tensor torch modules (x -> x), one per block.
      torch_pre: ``() -> x0`` (differentiable w.r.t. the torch params it uses).
      torch_post: ``y -> scalar loss``.
      torch_params: parity name -> torch Parameter, for every parameter
        (``blocks.<i>.<group>.<leaf>``, ``embed``, ``final_norm.scale``, ``lm_head``).
      jax_params: ``{'blocks': stacked, ...}`` with the same values.
      jax_block: eae_jax block function.
      jax_pre: ``params -> x0``.
      jax_post: ``(params, y) -> scalar loss``.
      torch_logits, jax_logits: optional ``y -> logits`` / ``(params, y) -> logits``
        for a forward row of the model's output.
      torch_model_logits: optional ``() -> logits`` of the unmodified torch
        model's own forward on the same tokens, for a second logits row that
        checks the per-block decomposition used on the torch side.
    """

    title: str
    dtype: str
    torch_blocks: list
    torch_pre: Callable
    torch_post: Callable
    torch_params: Dict[str, Any]
    jax_params: dict
    jax_block: Callable
    jax_pre: Callable
    jax_post: Callable
    torch_logits: Optional[Callable] = None
    jax_logits: Optional[Callable] = None
    torch_model_logits: Optional[Callable] = None


def _torch_dtype(dtype: str):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _check_dtype(dtype: str) -> str:
    if dtype in ("fp32", "f32"):
        dtype = "float32"
    if dtype in ("bf16",):
        dtype = "bfloat16"
    if dtype not in TOLERANCES:
        raise ValueError(f"parity runs in float32 or bfloat16, got {dtype!r}")
    return dtype


def _named_block_params(blocks: Sequence[Any], layout: BlockLayout) -> Dict[str, Any]:
    out = {}
    for i, b in enumerate(blocks):
        for k, p in b.named_parameters():
            if k not in layout.keys:
                raise ValueError(f"block {i} has parameter {k!r} that the {layout.name} layout does not know")
            a, c = layout.keys[k]
            out[f"blocks.{i}.{a}.{c}"] = p
    return out


def _cast_tree(tree, dtype):
    dt = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a).astype(dt), tree)


def _perturb(params: dict, perturb: float, seed: int) -> dict:
    """Add ``perturb * rms(w) * N(0, 1)`` to block 0's wq (only on the JAX side)."""
    if not perturb:
        return params
    wq = params["blocks"]["attn"]["wq"]
    w0 = wq[0].astype(jnp.float32)
    noise = jax.random.normal(jax.random.key(seed + 7), w0.shape, jnp.float32)
    rms = jnp.sqrt(jnp.mean(w0 * w0))
    new0 = (w0 + perturb * rms * noise).astype(wq.dtype)
    blocks = dict(params["blocks"])
    blocks["attn"] = dict(blocks["attn"], wq=wq.at[0].set(new0))
    return dict(params, blocks=blocks)


def blocks_case(blocks: Any, *, dtype: str = "float32", batch: int = 2, seq: int = 16, seed: int = 0,
                perturb: float = 0.0, title: Optional[str] = None) -> ParityCase:
    """Parity case for a stack of eae_runtime PreNormTransformerBlock.

    Inputs ``x ~ N(0, 1)`` of shape ``(batch, seq, dim)`` and a target
    ``t ~ N(0, 1)``; loss ``0.5 * sum((xL - t)**2)`` in float32 (a sum, so
    the output adjoint has norm well above 1 and ClipPass(1.0) acts).

    Args:
      blocks: ``nn.ModuleList`` / list of PreNormTransformerBlock. They are
        deep-copied and the copies converted to ``dtype``; the caller's
        modules are left alone.
      perturb: relative noise added to block 0's wq on the JAX side only
        (to demonstrate a failing run).
    """
    import copy

    from interop.torch_blocks import import_seed_blocks

    dtype = _check_dtype(dtype)
    tdt = _torch_dtype(dtype)
    mods = copy.deepcopy(list(blocks))
    for m in mods:
        m.to(tdt).eval()
    imported = import_seed_blocks(mods)
    cfg = imported.config
    _check_run_shape(batch, seq, cfg.max_seq_len, "the blocks' RoPE tables")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, cfg.dim, generator=gen).to(tdt)
    target = torch.randn(batch, seq, cfg.dim, generator=gen)
    jparams = _perturb({"blocks": imported.params}, perturb, seed)
    jx, jt = jnp.asarray(torch_to_numpy(x)), jnp.asarray(target.numpy())

    def torch_pre():
        return x.clone().requires_grad_(True)

    def torch_post(y):
        return 0.5 * ((y.float() - target) ** 2).sum()

    def jax_post(params, y):
        return 0.5 * jnp.sum((y.astype(jnp.float32) - jt) ** 2)

    kv = cfg.num_kv_heads
    kind = "MHA" if kv == cfg.num_heads else ("MQA" if kv == 1 else "GQA")
    return ParityCase(
        title or f"PreNormTransformerBlock x{len(mods)} ({kind}: dim {cfg.dim}, heads {cfg.num_heads}, kv {kv})",
        dtype, mods, torch_pre, torch_post, _named_block_params(mods, SEED_BLOCK), jparams, decoder_block(cfg),
        lambda p: jx, jax_post)


def _check_run_shape(batch: int, seq: int, max_seq: int, what: str) -> None:
    """ValueError unless ``batch`` and ``seq`` are ints >= 1 and ``seq <= max_seq``
    (checked before any model runs: torch would fail with a traceback)."""
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if seq > max_seq:
        raise ValueError(f"seq {seq} is longer than {what} allow (max_seq_len {max_seq})")


def _tokens(vocab: int, batch: int, seq: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int64)


def _tokens_for(cfg: LMConfig, batch: int, seq: int, seed: int, tokens: Optional[np.ndarray]) -> np.ndarray:
    """The case's token ids ``(batch, seq + 1)``: random ones, or ``tokens`` checked against the model."""
    if tokens is None:
        _check_run_shape(batch, seq, cfg.block.max_seq_len, "the model's position tables")
        return _tokens(cfg.vocab_size, batch, seq, seed)
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be (batch, seq + 1) ids with seq >= 1, got shape {tokens.shape}")
    _check_run_shape(int(tokens.shape[0]), int(tokens.shape[1]) - 1, cfg.block.max_seq_len,
                     "the model's position tables")
    return tokens


def _lm_case_common(cfg: LMConfig, params: dict, tokens: np.ndarray, perturb: float, seed: int):
    jparams = _perturb(params, perturb, seed)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    j_in, j_tg = jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32)
    t_tg = torch.from_numpy(targets)
    table = "embed" if cfg.tie_embeddings else "lm_head"

    def jax_pre(p):
        return embed(p["embed"], j_in)

    def jax_logits(p, y):
        return head(p["final_norm"], p[table], y, cfg.block.norm_eps)

    def jax_post(p, y):
        logits = jax_logits(p, y)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, j_tg[..., None], axis=-1)[..., 0]
        return jnp.sum(logz - picked)

    def torch_ce(logits):
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), t_tg.reshape(-1),
                                                 reduction="sum")

    return jparams, inputs, jax_pre, jax_logits, jax_post, torch_ce


def seed_lm_case(model: Any, params: dict, cfg: LMConfig, *, dtype: str = "float32", batch: int = 2, seq: int = 32,
                 seed: int = 0, tokens: Optional[np.ndarray] = None, perturb: float = 0.0,
                 title: str = "seed-block LM") -> ParityCase:
    """Parity case for a whole LM: `interop.reference.SeedBlockLM` (torch) vs eae_jax LM params.

    Loss: summed next-token cross-entropy on ``tokens`` (random ids by default).
    ``model`` and ``params`` must hold the same weights (e.g. both from one
    checkpoint import); the model is converted to ``dtype`` on a deep copy.
    """
    import copy

    dtype = _check_dtype(dtype)
    tokens = _tokens_for(cfg, batch, seq, seed, tokens)
    model = copy.deepcopy(model).to(_torch_dtype(dtype)).eval()
    params = _cast_tree(params, dtype)
    jparams, inputs, jax_pre, jax_logits, jax_post, torch_ce = _lm_case_common(cfg, params, tokens, perturb, seed)
    t_in = torch.from_numpy(inputs)
    named = _named_block_params(model.blocks, SEED_BLOCK)
    named["embed"] = model.embed.weight
    named["final_norm.scale"] = model.norm.weight
    if model.head is not None:
        named["lm_head"] = model.head.weight
    return ParityCase(
        title, dtype, list(model.blocks), lambda: model.embed(t_in), lambda y: torch_ce(model.logits(y)), named,
        jparams, decoder_block(cfg.block), jax_pre, jax_post, torch_logits=model.logits, jax_logits=jax_logits,
        torch_model_logits=lambda: model(t_in))


class _HFLayer(torch.nn.Module):
    """One transformers LlamaDecoderLayer as a single-tensor block (x -> x), as
    EAERuntime needs: RoPE cos/sin and the causal mask are built inside."""

    def __init__(self, layer, rotary):
        super().__init__()
        self.layer = layer
        self.rotary = [rotary]  # a list keeps it out of this module's parameters/buffers

    def forward(self, x):
        batch, seq, _ = x.shape
        pos = torch.arange(seq, device=x.device)[None].expand(batch, seq)
        cos_sin = self.rotary[0](x, pos)
        mask = torch.full((seq, seq), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
        out = self.layer(x, attention_mask=mask[None, None].expand(batch, 1, seq, seq), position_ids=pos,
                         position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out


def hf_lm_case(model: Any, params: dict, cfg: LMConfig, *, dtype: str = "float32", batch: int = 2, seq: int = 16,
               seed: int = 0, tokens: Optional[np.ndarray] = None, perturb: float = 0.0,
               title: str = "transformers LlamaForCausalLM") -> ParityCase:
    """Parity case for a ``transformers`` LlamaForCausalLM vs eae_jax LM params
    (``rope_style='half'``). The forward section also compares the logits of
    the unmodified ``model(tokens)`` call, so the per-layer wrapping used for
    the boundaries is itself checked against the real model."""
    import copy

    dtype = _check_dtype(dtype)
    tokens = _tokens_for(cfg, batch, seq, seed, tokens)
    model = copy.deepcopy(model).to(_torch_dtype(dtype)).eval()
    params = _cast_tree(params, dtype)
    jparams, inputs, jax_pre, jax_logits, jax_post, torch_ce = _lm_case_common(cfg, params, tokens, perturb, seed)
    t_in = torch.from_numpy(inputs)
    inner = model.model
    blocks = [_HFLayer(layer, inner.rotary_emb) for layer in inner.layers]
    named = {}
    for i, layer in enumerate(inner.layers):
        for k, p in layer.named_parameters():
            a, c = HF_BLOCK.keys[k]
            named[f"blocks.{i}.{a}.{c}"] = p
    named["embed"] = inner.embed_tokens.weight
    named["final_norm.scale"] = inner.norm.weight
    if not cfg.tie_embeddings:
        named["lm_head"] = model.lm_head.weight

    def torch_logits(y):
        return model.lm_head(inner.norm(y)).float()

    return ParityCase(title, dtype, blocks, lambda: inner.embed_tokens(t_in), lambda y: torch_ce(torch_logits(y)),
                      named, jparams, decoder_block(cfg.block), jax_pre, jax_post, torch_logits=torch_logits,
                      jax_logits=jax_logits, torch_model_logits=lambda: model(t_in).logits)


def checkpoint_case(path: str, *, dtype: str = "float32", batch: int = 2, seq: int = 16, seed: int = 0,
                    perturb: float = 0.0) -> ParityCase:
    """Parity case for a checkpoint file or directory, whatever its format.

    * Hugging Face directory: eae_jax import vs ``LlamaForCausalLM.from_pretrained``
      (transformers loads the weights itself: an independent path).
    * llama2.c ``.bin`` / ``.pt``: eae_jax import vs `interop.reference.SeedBlockLM`
      holding the same tensors.
    * ``.pt`` of a PreNormTransformerBlock ModuleList: the loaded modules vs their import.

    Raises:
      UnknownFormatError (and the loaders' errors) for anything else.
    """
    from interop.errors import UnknownFormatError
    from interop.safe_load import detect_format, load_torch_file

    fmt = detect_format(path)
    name = path.rstrip("/").split("/")[-1]
    if fmt in ("hf_dir", "safetensors"):
        from transformers import LlamaForCausalLM

        from interop.hf_llama import load_hf

        imported = load_hf(path, dtype=dtype)
        directory = path if fmt == "hf_dir" else (path.rsplit("/", 1)[0] if "/" in path else ".")
        model = LlamaForCausalLM.from_pretrained(directory)
        return hf_lm_case(model, imported.params, imported.config, dtype=dtype, batch=batch, seq=seq, seed=seed,
                          perturb=perturb, title=f"{name} (Hugging Face LLaMA) vs transformers")
    if fmt.startswith("llama2c_bin"):
        from interop.llama2c import load_llama2c_bin
        from interop.reference import seed_lm_from_params

        imported = load_llama2c_bin(path, dtype=dtype)
        return seed_lm_case(seed_lm_from_params(imported.params, imported.config), imported.params, imported.config,
                            dtype=dtype, batch=batch, seq=seq, seed=seed, perturb=perturb,
                            title=f"{name} (llama2.c) vs seed blocks")
    if fmt == "torch_pickle":
        obj = load_torch_file(path, allow_modules=True)
        if isinstance(obj, dict) and "model_args" in obj and "model" in obj:
            from interop.llama2c import import_llama2c_checkpoint
            from interop.reference import seed_lm_from_params

            imported = import_llama2c_checkpoint(obj, dtype=dtype, where=path)
            return seed_lm_case(seed_lm_from_params(imported.params, imported.config), imported.params,
                                imported.config, dtype=dtype, batch=batch, seq=seq, seed=seed, perturb=perturb,
                                title=f"{name} (llama2.c .pt) vs seed blocks")
        if isinstance(obj, (torch.nn.ModuleList, torch.nn.Sequential)):
            return blocks_case(obj, dtype=dtype, batch=batch, seq=seq, seed=seed, perturb=perturb,
                               title=f"{name} (PreNormTransformerBlock x{len(obj)})")
        raise UnknownFormatError(
            f"{path}: a torch pickle holding {type(obj).__name__}; parity needs a llama2.c checkpoint "
            "(model_args + model) or a saved ModuleList of PreNormTransformerBlock (a bare state dict lacks "
            "the configuration)")
    raise UnknownFormatError(f"{path}: no parity recipe for format {fmt}")


# --------------------------------------------------------------------------- engine
class _Recorder:
    """A seed pass (duck-typed ``EAEPass``: a ``name`` and ``__call__(adjoint, context)``)
    that keeps every adjoint it sees, keyed by boundary (the seed's ``block_index``).
    Put first in the pipeline it sees the raw VJP output, last what flows on."""

    def __init__(self, name: str):
        self.name = name
        self.adjoints: Dict[int, Any] = {}

    def __call__(self, adjoint, context=None):
        self.adjoints[int((context or {})["block_index"])] = adjoint.tensor.detach().clone()
        adjoint.record(self.name)
        return adjoint


def _torch_autograd(case: ParityCase):
    for p in case.torch_params.values():
        p.grad = None
    with torch.enable_grad():
        x0 = case.torch_pre()
        x0.retain_grad()
        xs = [x0]
        for b in case.torch_blocks:
            xs.append(b(xs[-1]))
        loss = case.torch_post(xs[-1])
        loss.backward()
    grads = {k: (torch_to_numpy(p.grad) if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
             for k, p in case.torch_params.items()}
    logits = None
    if case.torch_logits is not None:
        with torch.no_grad():
            logits = torch_to_numpy(case.torch_logits(xs[-1].detach()))
    return ([torch_to_numpy(x.detach()) for x in xs], torch_to_numpy(x0.grad), grads, float(loss.detach()), logits)


def _torch_runtime(case: ParityCase, pipeline: str):
    """EAERuntime.compute_gradients with the seed pipeline between two recorders.

    Returns (pre-pass adjoints, post-pass adjoints, named block param grads),
    the adjoint lists indexed by boundary 0..L.
    """
    from eae_runtime import EAERuntime, RuntimeConfig

    before, after = _Recorder("ParityRecorderIn"), _Recorder("ParityRecorderOut")
    runtime = EAERuntime(torch.nn.ModuleList(case.torch_blocks), None,
                         RuntimeConfig(passes=[before] + torch_pipeline(pipeline) + [after], enable_profiler=False))
    with torch.no_grad():
        x0 = case.torch_pre().detach()
    _, grads = runtime.compute_gradients(x0, case.torch_post)
    names = {id(p): k for k, p in case.torch_params.items()}
    named = {names[id(p)]: torch_to_numpy(g) for p, g in grads.items()}
    n = len(case.torch_blocks) + 1
    pre = [torch_to_numpy(before.adjoints[i]) for i in range(n)]
    post = [torch_to_numpy(after.adjoints[i]) for i in range(n)]
    for p in case.torch_params.values():
        p.grad = None
    return pre, post, named


def _jax_block_vjp(case: ParityCase):
    """jitted ``(params_i, x_i, g) -> (input adjoint, param grads)`` of one block."""
    block = case.jax_block

    @jax.jit
    def step(p_i, x_i, g):
        _, vjp = jax.vjp(block, p_i, x_i)
        g_p, g_x = vjp(g)
        return g_x, g_p

    return step


def _jax_pass_step(pipeline: str, num_boundaries: int):
    """jitted ``(adjoint, boundary) -> adjoint`` through the pipeline's eae_jax chain (fresh state)."""
    chain = jpasses.chain(*jax_pipeline(pipeline))

    @jax.jit
    def step(g, boundary):
        state = chain.init(jax.ShapeDtypeStruct(g.shape, g.dtype), jax.random.key(0))
        b = jnp.asarray(boundary, jnp.int32)
        ctx = jpasses.PassContext(b, b, jnp.zeros((), jnp.int32), num_boundaries)
        return chain.update(g, state, ctx)[0]

    return step


def _jax_forward(case: ParityCase, params):
    block = case.jax_block

    @jax.jit
    def run(params):
        x0 = case.jax_pre(params)

        def body(h, p):
            y = block(p, h)
            return y, y

        _, ys = jax.lax.scan(body, x0, params["blocks"])
        logits = case.jax_logits(params, ys[-1]) if case.jax_logits is not None else None
        return x0, ys, logits

    x0, ys, logits = run(params)
    xs = [np.asarray(x0)] + [np.asarray(y) for y in ys]
    return xs, (None if logits is None else np.asarray(logits))


def _flat_grads(g: dict) -> Dict[str, np.ndarray]:
    """Parity names -> numpy gradient (stacked block leaves split per block)."""
    out = {}
    blocks = g["blocks"]
    depth = jax.tree_util.tree_leaves(blocks)[0].shape[0]
    for a, sub in blocks.items():
        for c, leaf in sub.items():
            leaf = np.asarray(leaf)
            for i in range(depth):
                out[f"blocks.{i}.{a}.{c}"] = leaf[i]
    if "embed" in g:
        out["embed"] = np.asarray(g["embed"])
    if "final_norm" in g:
        out["final_norm.scale"] = np.asarray(g["final_norm"]["scale"])
    if "lm_head" in g:
        out["lm_head"] = np.asarray(g["lm_head"])
    return out


def _jax_pipeline(case: ParityCase, params, pipeline: str):
    """`eae_jax.reconstruct` with the pipeline's passes and a trailing ``capture()``.

    Returns (loss, adjoints after the passes at boundaries 0..L, named
    gradients of every parameter). With no passes the boundary-0 adjoint is
    dL/dx0 and the gradients are the plain ones (section (b)).
    """
    stack = eae_jax.reconstruct(case.jax_block, passes=jax_pipeline(pipeline) + [jpasses.capture()])
    carry = stack.init(params["blocks"], case.jax_pre(params))

    @jax.jit
    def run(params, carry):
        def loss_fn(params, carry):
            return case.jax_post(params, stack(params["blocks"], case.jax_pre(params), carry))

        loss, (g_params, g_carry) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, carry)
        new_carry, stats = stack.update(carry, g_carry)
        return loss, g_params, stack.state(new_carry), stats

    loss, g_params, state, stats = run(params, carry)
    if float(stats["calls"]) != 1.0:
        raise RuntimeError(f"reconstruct's backward ran {float(stats['calls'])} times for one step; "
                           "the captured adjoints are unusable")
    below = np.asarray(state["segments"][0][-1].adjoint)  # boundaries 0..L-1, stacked
    top = np.asarray(state["top"][-1].adjoint)  # boundary L
    adjoints = [below[i] for i in range(below.shape[0])] + [top]
    return float(loss), adjoints, _flat_grads(g_params)


def _block_groups(names: Sequence[str]) -> Dict[str, List[str]]:
    """Group parity names into report rows: ``block i`` (all its tensors), then the rest."""
    groups: Dict[str, List[str]] = {}
    for n in names:
        if n.startswith("blocks."):
            groups.setdefault(f"block {int(n.split('.')[1])}", []).append(n)
        else:
            groups.setdefault(n, []).append(n)
    return groups


def _concat(d: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.asarray(d[n], np.float64).ravel() for n in names])


def run_parity(case: ParityCase, *, pipelines: Sequence[str] = PIPELINES, tol: Optional[float] = None,
               info: Optional[dict] = None) -> ParityReport:
    """Run the torch reference and the JAX port on ``case`` and compare (see the module doc).

    Args:
      case: from `blocks_case`, `seed_lm_case`, `hf_lm_case`, `checkpoint_case`
        or built by hand.
      pipelines: which pass pipelines to compare in section (c) (a subset of
        `PIPELINES`; empty skips the EAERuntime comparison).
      tol: override the relative-error tolerance of every row (e.g. a tiny
        value to force a failure); default `TOLERANCES` of the case's dtype
        (with `END_TO_END_FLOOR` for end-to-end rows of quantizing pipelines).
      info: extra facts to put in the report.

    Returns:
      A `ParityReport`; ``report.ok`` says whether every row passed.

    Raises:
      ValueError: unknown pipeline, or the two sides do not name the same parameters.
    """
    for p in pipelines:
        if p not in PIPELINES:
            raise ValueError(f"unknown pipeline {p!r}; expected one of {PIPELINES}")
    base_tol = TOLERANCES[case.dtype] if tol is None else float(tol)
    rows: List[Row] = []

    def add(section, name, got, want, row_tol):
        m, r, c = compare(got, want)
        rows.append(Row(section, name, m, r, c, row_tol, bool(r <= row_tol)))

    params = case.jax_params
    t_xs, t_gx0, t_grads, t_loss, t_logits = _torch_autograd(case)
    j_xs, j_logits = _jax_forward(case, params)
    for i, (a, b) in enumerate(zip(j_xs, t_xs)):
        add("forward", f"x{i}", a, b, base_tol)
    if t_logits is not None:
        add("forward", "logits", j_logits, t_logits, base_tol)
    if case.torch_model_logits is not None:
        with torch.no_grad():
            whole = torch_to_numpy(case.torch_model_logits().float())
        add("forward", "logits(model)", j_logits, whole, base_tol)
    runs = {p: _jax_pipeline(case, params, p) for p in dict.fromkeys(["none", *pipelines])}
    j_loss, j_adj_none, j_grads = runs["none"]
    add("forward", "loss", j_loss, t_loss, base_tol)
    if set(j_grads) != set(t_grads):
        raise ValueError(f"the JAX and torch sides name different parameters: only JAX {sorted(set(j_grads) - set(t_grads))}, "
                         f"only torch {sorted(set(t_grads) - set(j_grads))}")
    add("grad", "dL/dx0", j_adj_none[0], t_gx0, base_tol)
    for group, names in _block_groups(list(t_grads)).items():
        add("grad", group, _concat(j_grads, names), _concat(t_grads, names), base_tol)

    depth = len(case.torch_blocks)
    block_groups = _block_groups([n for n in t_grads if n.startswith("blocks.")])
    vjp_step = _jax_block_vjp(case) if pipelines else None
    e2e_tols = {}
    for pipe in pipelines:
        e2e_tol = max(base_tol, END_TO_END_FLOOR[pipe]) if tol is None else base_tol
        e2e_tols[pipe] = e2e_tol
        t_pre, t_post, t_pg = _torch_runtime(case, pipe)
        _, j_adj, j_pg = runs[pipe]
        for i in reversed(range(depth + 1)):
            add(f"adjoint[{pipe}]", f"x{i}", j_adj[i], t_post[i], e2e_tol)
        for group, names in block_groups.items():
            add(f"adjoint[{pipe}]", f"{group} grads", _concat(j_pg, names), _concat(t_pg, names), e2e_tol)
        # One block at a time, from the seed's own boundary and incoming adjoint.
        for i in reversed(range(depth)):
            p_i = jax.tree_util.tree_map(lambda l: l[i], params["blocks"])
            x_i = jnp.asarray(t_xs[i])
            g_x, g_p = vjp_step(p_i, x_i, jnp.asarray(t_post[i + 1]))
            add(f"vjp[{pipe}]", f"x{i}", np.asarray(g_x), t_pre[i], base_tol)
            names = block_groups[f"block {i}"]
            got = _flat_grads({"blocks": jax.tree_util.tree_map(lambda l: l[None], g_p)})
            got = {k.replace("blocks.0.", f"blocks.{i}.", 1): v for k, v in got.items()}
            add(f"vjp[{pipe}]", f"block {i} grads", _concat(got, names), _concat(t_pg, names), base_tol)
        if pipe != "none":
            pass_step = _jax_pass_step(pipe, depth + 1)
            for i in reversed(range(depth + 1)):
                add(f"pass[{pipe}]", f"x{i}", np.asarray(pass_step(jnp.asarray(t_pre[i]), i)), t_post[i], base_tol)

    meta = {"depth": depth, "x0_shape": list(t_xs[0].shape), "loss_torch": t_loss, "loss_jax": j_loss,
            "pipelines": list(pipelines), "tolerance": base_tol, "end_to_end_tolerances": e2e_tols}
    meta.update(info or {})
    return ParityReport(case.title, case.dtype, rows, meta)
