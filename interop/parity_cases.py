"""Parity cases: the same model on the torch and the JAX side (see `interop.parity`)."""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eae_jax.blocks import decoder_block
from eae_jax.models import LMConfig, embed, head
from interop.layout import BlockLayout, HF_BLOCK, SEED_BLOCK
from interop.tensors import require_torch, torch_to_numpy

torch = require_torch()

#: Relative-error tolerance per compute dtype.
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2}


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

    Example:
      >>> from torch.nn import ModuleList
      >>> from eae_runtime.contrib import PreNormTransformerBlock
      >>> from interop.parity_cases import ParityCase, blocks_case
      >>> blocks = ModuleList([PreNormTransformerBlock(8, 2, max_seq_len=8, ffn_hidden_dim=16)])
      >>> case = blocks_case(blocks, batch=1, seq=4)
      >>> isinstance(case, ParityCase), case.dtype, case.jax_params["blocks"]["attn"]["wq"].shape
      (True, 'float32', (1, 8, 8))
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

    Example:
      >>> import torch
      >>> from eae_runtime.contrib import PreNormTransformerBlock
      >>> from interop.parity_cases import blocks_case
      >>> block = PreNormTransformerBlock(8, 2, max_seq_len=8, ffn_hidden_dim=16)
      >>> case = blocks_case(torch.nn.ModuleList([block]), batch=1, seq=4, seed=3)
      >>> x0 = case.torch_pre()
      >>> tuple(x0.shape), float(case.torch_post(block(x0))) > 0       # a summed squared error
      ((1, 4, 8), True)
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


class _LMCase(NamedTuple):
    """What the two LM cases share: the model and params in the case's dtype, and the loss pieces."""

    dtype: str
    model: Any
    t_in: Any
    jparams: dict
    jax_pre: Callable
    jax_logits: Callable
    jax_post: Callable
    torch_ce: Callable


def _lm_case_common(model: Any, params: dict, cfg: LMConfig, dtype: str, batch: int, seq: int, seed: int,
                    tokens: Optional[np.ndarray], perturb: float) -> _LMCase:
    """Check the dtype, draw the tokens, put a copy of the torch model and the params in the dtype, and
    build the loss of both sides (summed next-token cross-entropy)."""
    import copy

    dtype = _check_dtype(dtype)
    tokens = _tokens_for(cfg, batch, seq, seed, tokens)
    model = copy.deepcopy(model).to(_torch_dtype(dtype)).eval()
    jparams = _perturb(_cast_tree(params, dtype), perturb, seed)
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

    return _LMCase(dtype, model, torch.from_numpy(inputs), jparams, jax_pre, jax_logits, jax_post, torch_ce)


def seed_lm_case(model: Any, params: dict, cfg: LMConfig, *, dtype: str = "float32", batch: int = 2, seq: int = 32,
                 seed: int = 0, tokens: Optional[np.ndarray] = None, perturb: float = 0.0,
                 title: str = "seed-block LM") -> ParityCase:
    """Parity case for a whole LM: `interop.reference.SeedBlockLM` (torch) vs eae_jax LM params.

    Loss: summed next-token cross-entropy on ``tokens`` (random ids by default).
    ``model`` and ``params`` must hold the same weights (e.g. both from one
    checkpoint import); the model is converted to ``dtype`` on a deep copy.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from interop.parity import run_parity, seed_lm_case
      >>> cfg = LMConfig(32, 1, BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=8))
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> from interop.reference import seed_lm_from_params
      >>> case = seed_lm_case(seed_lm_from_params(params, cfg), params, cfg, batch=1, seq=4)
      >>> run_parity(case, pipelines=[]).ok
      True
    """
    common = _lm_case_common(model, params, cfg, dtype, batch, seq, seed, tokens, perturb)
    model, t_in = common.model, common.t_in
    named = _named_block_params(model.blocks, SEED_BLOCK)
    named["embed"] = model.embed.weight
    named["final_norm.scale"] = model.norm.weight
    if model.head is not None:
        named["lm_head"] = model.head.weight
    return ParityCase(
        title, common.dtype, list(model.blocks), lambda: model.embed(t_in),
        lambda y: common.torch_ce(model.logits(y)), named, common.jparams, decoder_block(cfg.block), common.jax_pre,
        common.jax_post, torch_logits=model.logits, jax_logits=common.jax_logits,
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
    the boundaries is itself checked against the real model.

    Example:
      >>> from interop.parity import hf_lm_case, run_parity
      >>> import jax
      >>> from interop.hf_llama import to_transformers
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> block = BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=8, rope_style="half")
      >>> cfg = LMConfig(32, 1, block)
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> report = run_parity(hf_lm_case(to_transformers(params, cfg), params, cfg, batch=1, seq=4), pipelines=[])
      >>> report.ok
      True
    """
    common = _lm_case_common(model, params, cfg, dtype, batch, seq, seed, tokens, perturb)
    model, t_in = common.model, common.t_in
    inner = model.model
    blocks = [_HFLayer(layer, inner.rotary_emb) for layer in inner.layers]
    named = {}
    for i, layer in enumerate(inner.layers):
        for k, p in layer.named_parameters():
            module, leaf = HF_BLOCK.keys[k]
            named[f"blocks.{i}.{module}.{leaf}"] = p
    named["embed"] = inner.embed_tokens.weight
    named["final_norm.scale"] = inner.norm.weight
    if not cfg.tie_embeddings:
        named["lm_head"] = model.lm_head.weight

    def torch_logits(y):
        return model.lm_head(inner.norm(y)).float()

    return ParityCase(title, common.dtype, blocks, lambda: inner.embed_tokens(t_in),
                      lambda y: common.torch_ce(torch_logits(y)), named, common.jparams, decoder_block(cfg.block),
                      common.jax_pre, common.jax_post, torch_logits=torch_logits, jax_logits=common.jax_logits,
                      torch_model_logits=lambda: model(t_in).logits)


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

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, save_llama2c_bin
      >>> from interop.parity import checkpoint_case, run_parity
      >>> args = {"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16, "max_seq_len": 8}
      >>> path, cfg = os.path.join(tempfile.mkdtemp(), "m.bin"), lm_config_from_model_args(args)
      >>> save_llama2c_bin(path, init_lm(jax.random.key(0), cfg), cfg)
      >>> run_parity(checkpoint_case(path, batch=1, seq=4), pipelines=[]).ok
      True
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
