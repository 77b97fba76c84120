"""Name maps between flat torch state dicts and eae_jax param trees.

Each supported format names the same nine tensors of a LLaMA block
differently; a `BlockLayout` maps the torch names (relative to one layer)
to the eae_jax path. Tensors are moved as they are: eae_jax stores linear
weights in torch's ``(out, in)`` layout, so no transposes or reorderings
happen anywhere in this package.

The strict check (`check_tensors`) collects every missing key, unexpected
key and shape mismatch and raises them together as one
`CheckpointMismatchError`.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Mapping, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from interop.errors import CheckpointMismatchError, Float64CheckpointError
from interop.tensors import cast, same_bits


class BlockLayout(NamedTuple):
    """How one block's tensors are named inside a torch checkpoint.

    Attributes:
      name: the format's name (for messages).
      keys: torch name within one layer -> eae_jax path, in the order
        exports write them.

    Example:
      >>> from interop.layout import HF_BLOCK
      >>> HF_BLOCK.keys["mlp.gate_proj.weight"], len(HF_BLOCK.keys)
      (('ffn', 'w_gate'), 9)
    """

    name: str
    keys: Mapping[str, Tuple[str, str]]


class LMLayout(NamedTuple):
    """How a whole language model is named inside a torch checkpoint.

    Attributes:
      block: the per-layer names.
      layer_prefix: format string of a layer's prefix, e.g. ``'model.layers.{i}.'``.
      embed, final_norm, head: names of the token table, final norm gain and
        output projection (None when the format has none of them).
      ignore: regexes of non-parameter buffers older exporters wrote (RoPE
        ``inv_freq`` ...); they are skipped, everything else unknown is an error.

    Example:
      >>> from interop.layout import LLAMA2C_LM
      >>> LLAMA2C_LM.layer_prefix.format(i=3) + "attention.wq.weight", LLAMA2C_LM.embed
      ('layers.3.attention.wq.weight', 'tok_embeddings.weight')
    """

    block: BlockLayout
    layer_prefix: str
    embed: Optional[str] = None
    final_norm: Optional[str] = None
    head: Optional[str] = None
    ignore: Tuple[str, ...] = ()


#: One row per block tensor: its eae_jax path, then its name within a layer in the
#: eae_runtime seed, Hugging Face and llama2.c checkpoints (a layer's tensors are
#: written in this order in every format).
_BLOCK_NAMES = (
    (("attn_norm", "scale"), "attn_norm.weight", "input_layernorm.weight", "attention_norm.weight"),
    (("attn", "wq"), "attn.q_proj.weight", "self_attn.q_proj.weight", "attention.wq.weight"),
    (("attn", "wk"), "attn.k_proj.weight", "self_attn.k_proj.weight", "attention.wk.weight"),
    (("attn", "wv"), "attn.v_proj.weight", "self_attn.v_proj.weight", "attention.wv.weight"),
    (("attn", "wo"), "attn.out_proj.weight", "self_attn.o_proj.weight", "attention.wo.weight"),
    (("ffn_norm", "scale"), "ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
    (("ffn", "w_gate"), "ffn.gate_proj.weight", "mlp.gate_proj.weight", "feed_forward.w1.weight"),
    (("ffn", "w_down"), "ffn.down_proj.weight", "mlp.down_proj.weight", "feed_forward.w2.weight"),
    (("ffn", "w_up"), "ffn.up_proj.weight", "mlp.up_proj.weight", "feed_forward.w3.weight"),
)
SEED_BLOCK, HF_BLOCK, LLAMA2C_BLOCK = (
    BlockLayout(name, {row[column]: row[0] for row in _BLOCK_NAMES})
    for column, name in enumerate(("eae_runtime PreNormTransformerBlock", "Hugging Face LlamaDecoderLayer",
                                   "llama2.c TransformerBlock"), start=1)
)

SEED_STACK = LMLayout(SEED_BLOCK, "{i}.")
HF_LM = LMLayout(
    HF_BLOCK, "model.layers.{i}.", embed="model.embed_tokens.weight", final_norm="model.norm.weight",
    head="lm_head.weight", ignore=(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$", r"^model\.rotary_emb\.inv_freq$"),
)
LLAMA2C_LM = LMLayout(
    LLAMA2C_BLOCK, "layers.{i}.", embed="tok_embeddings.weight", final_norm="norm.weight", head="output.weight",
    ignore=(r"^freqs_cos$", r"^freqs_sin$"),
)


def block_shapes(layout: BlockLayout, block_cfg) -> Dict[str, tuple]:
    """torch name within a layer -> expected shape, from a `BlockConfig`.

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from interop.layout import SEED_BLOCK, block_shapes
      >>> shapes = block_shapes(SEED_BLOCK, BlockConfig(dim=8, num_heads=2, num_kv_heads=1, ffn_hidden_dim=16))
      >>> shapes["attn.k_proj.weight"], shapes["ffn.down_proj.weight"]
      ((4, 8), (8, 16))
    """
    shapes = block_cfg.param_shapes()
    return {k: tuple(shapes[a][b]) for k, (a, b) in layout.keys.items()}


def expected_lm_shapes(layout: LMLayout, block_cfg, depth: int, vocab_size: Optional[int] = None,
                       head: bool = True) -> Dict[str, tuple]:
    """Every tensor name a checkpoint of this model must contain, with its shape.

    Args:
      layout: the format.
      block_cfg: `BlockConfig` of every layer.
      depth: number of layers.
      vocab_size: needed when the layout has an embedding.
      head: whether the output projection must be present (False for tied models).

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from interop.layout import HF_LM, expected_lm_shapes
      >>> cfg = BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16)
      >>> shapes = expected_lm_shapes(HF_LM, cfg, depth=2, vocab_size=32, head=False)
      >>> len(shapes), shapes["model.embed_tokens.weight"], "lm_head.weight" in shapes
      (20, (32, 8), False)
    """
    out = {}
    if layout.embed:
        out[layout.embed] = (vocab_size, block_cfg.dim)
    per = block_shapes(layout.block, block_cfg)
    for i in range(depth):
        prefix = layout.layer_prefix.format(i=i)
        for k, s in per.items():
            out[prefix + k] = s
    if layout.final_norm:
        out[layout.final_norm] = (block_cfg.dim,)
    if layout.head and head:
        out[layout.head] = (vocab_size, block_cfg.dim)
    return out


def check_tensors(found: Mapping[str, Any], expected: Mapping[str, tuple], where: str,
                  ignore: Sequence[str] = (), optional: Iterable[str] = (), other: Iterable[str] = ()) -> None:
    """Raise one `CheckpointMismatchError` listing every problem, or return.

    Args:
      found: name -> tensor/array (anything with ``.shape``).
      expected: name -> shape the model needs.
      where: what is being checked (file name, format) for the message.
      ignore: regexes of names to skip silently (known non-parameter buffers).
      optional: names that may be present (and are then shape-checked) but
        need not be.
      other: extra problems found by the caller, reported in the same error.

    Expected tensors must also be floating point (an integer or bool tensor
    is reported with its name and dtype).

    Example:
      >>> import numpy as np
      >>> from interop.layout import check_tensors
      >>> found = {"a": np.zeros((2, 3)), "b": np.zeros(4), "extra": np.zeros(1)}
      >>> check_tensors(found, {"a": (2, 3), "b": (5,), "c": (1,)}, "example.pt")
      Traceback (most recent call last):
      ...
      interop.errors.CheckpointMismatchError: example.pt: checkpoint does not match the model
        missing keys (1):
          c
        unexpected keys (1):
          extra
        shape mismatches (1):
          b: checkpoint has (4,), model expects (5,)
    """
    optional = set(optional)
    other = list(other)
    patterns = [re.compile(p) for p in ignore]
    missing = [k for k in expected if k not in found and k not in optional]
    unexpected, shapes = [], []
    for k, v in found.items():
        if k in expected:
            got = tuple(getattr(v, "shape", ()))
            if got != tuple(expected[k]):
                shapes.append((k, got, tuple(expected[k])))
            dtype = getattr(v, "dtype", None)
            if dtype is not None and not jnp.issubdtype(np.dtype(dtype), jnp.floating):
                # An integer / bool tensor in a weight's place would be imported as is (and a dtype=
                # conversion would hide it): a wrong or corrupted checkpoint.
                other.append(f"{k}: dtype {np.dtype(dtype).name}, a weight must be floating point")
        elif not any(p.search(k) for p in patterns):
            unexpected.append(k)
    err = CheckpointMismatchError(where, missing, unexpected, shapes, other)
    if not err.empty:
        raise err


def to_jax(a: np.ndarray, name: str) -> jax.Array:
    """numpy -> JAX array keeping the dtype; refuses a silent float64 -> float32 drop.

    Raises:
      Float64CheckpointError: float64 data while jax_enable_x64 is off (ask
        for ``dtype='float32'`` to convert on purpose).

    Example:
      >>> import numpy as np
      >>> from interop.layout import to_jax
      >>> to_jax(np.ones(2, np.float32), "w").dtype.name
      'float32'
      >>> to_jax(np.ones(2, np.float64), "w")
      Traceback (most recent call last):
      ...
      interop.errors.Float64CheckpointError: w is float64 but JAX runs without x64, so it would be silently ...
    """
    if a.dtype == np.float64 and not jax.config.jax_enable_x64:
        raise Float64CheckpointError(
            f"{name} is float64 but JAX runs without x64, so it would be silently rounded to float32; "
            "pass dtype='float32' to convert on purpose, or enable jax_enable_x64"
        )
    return jnp.asarray(a)


def stack_blocks(tensors: Mapping[str, np.ndarray], layout: LMLayout, depth: int, dtype: Optional[np.dtype],
                 where: str) -> dict:
    """Gather the per-layer tensors into eae_jax's stacked block params (leading depth axis).

    The tensors must already have passed `check_tensors`. With ``dtype`` None
    every layer must store a leaf in the same dtype (a stacked leaf has one).

    Raises:
      CheckpointMismatchError: layers disagree on a tensor's dtype.

    Example:
      >>> import numpy as np
      >>> from eae_jax.blocks import BlockConfig
      >>> from interop.layout import SEED_STACK, block_shapes, stack_blocks
      >>> shapes = block_shapes(SEED_STACK.block, BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16))
      >>> tensors = {f"{i}.{name}": np.full(shape, i, np.float32) for i in range(2) for name, shape in shapes.items()}
      >>> params = stack_blocks(tensors, SEED_STACK, depth=2, dtype=None, where="example")
      >>> params["attn"]["wq"].shape, params["attn"]["wq"][1, 0, 0].item()      # layer 1 at index 1
      ((2, 8, 8), 1.0)
    """
    out: Dict[str, Dict[str, jax.Array]] = {}
    problems = []
    for key, (a, b) in layout.block.keys.items():
        names = [layout.layer_prefix.format(i=i) + key for i in range(depth)]
        arrays = [cast(tensors[n], dtype) for n in names]
        dtypes = sorted({str(x.dtype) for x in arrays})
        if len(dtypes) > 1:
            problems.append(f"{layout.layer_prefix.format(i='N')}{key}: layers store different dtypes {dtypes}; "
                            "pass dtype=... to convert them to one")
            continue
        out.setdefault(a, {})[b] = to_jax(np.stack(arrays), names[0])
    if problems:
        raise CheckpointMismatchError(where, other=problems)
    return out


def unstack_blocks(blocks: Mapping[str, Mapping[str, Any]], layout: LMLayout, depth: int) -> Dict[str, np.ndarray]:
    """eae_jax stacked block params -> ``{torch name: numpy array}`` in layer order.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig, init_stack
      >>> from interop.layout import SEED_STACK, unstack_blocks
      >>> params = init_stack(jax.random.key(0), BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16), depth=2)
      >>> flat = unstack_blocks(params, SEED_STACK, depth=2)
      >>> list(flat)[:2], flat["1.ffn.up_proj.weight"].shape
      (['0.attn_norm.weight', '0.attn.q_proj.weight'], (16, 8))
    """
    out = {}
    leaves = {k: np.asarray(blocks[a][b]) for k, (a, b) in layout.block.keys.items()}
    for i in range(depth):
        prefix = layout.layer_prefix.format(i=i)
        for k in layout.block.keys:
            out[prefix + k] = np.ascontiguousarray(leaves[k][i])
    return out


def lm_params_from_tensors(tensors: Mapping[str, np.ndarray], cfg, layout: LMLayout, dtype: Optional[np.dtype],
                           where: str) -> dict:
    """Strictly check a flat name -> numpy dict and build eae_jax LM params.

    A tied model (``cfg.tie_embeddings``) may carry the head tensor too (HF
    state dicts and llama2.c do); it must then equal the embedding bit for bit.

    Raises:
      CheckpointMismatchError: anything missing, unexpected, mis-shaped, or a
        tied head that differs from the embedding.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from interop.layout import HF_LM, lm_params_from_tensors, lm_tensors_from_params
      >>> cfg = LMConfig(vocab_size=32, depth=2, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16))
      >>> tensors = lm_tensors_from_params(init_lm(jax.random.key(0), cfg), cfg, HF_LM, tied_head=False)
      >>> sorted(lm_params_from_tensors(tensors, cfg, HF_LM, dtype=None, where="example"))
      ['blocks', 'embed', 'final_norm', 'lm_head']
      >>> del tensors["model.norm.weight"]
      >>> lm_params_from_tensors(tensors, cfg, HF_LM, dtype=None, where="example")
      Traceback (most recent call last):
      ...
      interop.errors.CheckpointMismatchError: example: checkpoint does not match the model
        missing keys (1):
          model.norm.weight
    """
    expected = expected_lm_shapes(layout, cfg.block, cfg.depth, cfg.vocab_size, head=not cfg.tie_embeddings)
    optional, other = [], []
    if cfg.tie_embeddings and layout.head:
        expected[layout.head] = (cfg.vocab_size, cfg.dim)
        optional.append(layout.head)
        head, emb = tensors.get(layout.head), tensors.get(layout.embed)
        if head is not None and emb is not None and head.shape == emb.shape and not same_bits(head, emb):
            other.append(f"the model is tied but {layout.head} differs from {layout.embed}; load it untied "
                         "(tie_embeddings=False) to keep both")
    check_tensors(tensors, expected, where, ignore=layout.ignore, optional=optional, other=other)
    params = {"embed": to_jax(cast(tensors[layout.embed], dtype), layout.embed),
              "blocks": stack_blocks(tensors, layout, cfg.depth, dtype, where),
              "final_norm": {"scale": to_jax(cast(tensors[layout.final_norm], dtype), layout.final_norm)}}
    if not cfg.tie_embeddings:
        params["lm_head"] = to_jax(cast(tensors[layout.head], dtype), layout.head)
    return params


def lm_tensors_from_params(params: Mapping[str, Any], cfg, layout: LMLayout, tied_head: bool) -> Dict[str, np.ndarray]:
    """eae_jax LM params -> ordered ``{torch name: numpy array}``.

    Args:
      params: LM params (checked with `eae_jax.models.check_lm_params`).
      cfg: its `LMConfig`.
      layout: the target format.
      tied_head: for a tied model, also write the head name (holding the
        embedding) as llama2.c and torch state dicts do.

    Raises:
      ValueError: params do not match ``cfg``.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from interop.layout import HF_LM, lm_tensors_from_params
      >>> cfg = LMConfig(vocab_size=32, depth=2, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16))
      >>> tensors = lm_tensors_from_params(init_lm(jax.random.key(0), cfg), cfg, HF_LM, tied_head=False)
      >>> list(tensors)[:2], len(tensors)              # embedding, 2 x 9 block tensors, norm, head
      (['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight'], 21)
    """
    from eae_jax.models import check_lm_params

    check_lm_params(params, cfg)
    out = {layout.embed: np.ascontiguousarray(np.asarray(params["embed"]))}
    out.update(unstack_blocks(params["blocks"], layout, cfg.depth))
    out[layout.final_norm] = np.ascontiguousarray(np.asarray(params["final_norm"]["scale"]))
    if not cfg.tie_embeddings:
        out[layout.head] = np.ascontiguousarray(np.asarray(params["lm_head"]))
    elif tied_head:
        out[layout.head] = out[layout.embed]
    return out
