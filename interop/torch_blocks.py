"""`eae_runtime.contrib.PreNormTransformerBlock` stacks <-> eae_jax block params.

Sources: an ``nn.ModuleList`` (or list / ``nn.Sequential``) of reference
blocks, its ``state_dict()``, or a ``.pt`` file holding either. From modules
the whole configuration is read off the modules themselves: width, heads,
kv heads, FFN width, RMSNorm eps, RoPE table length and the RoPE base
(recovered from the cos/sin buffers and verified against them). A bare state
dict does not record head counts or eps, so it needs ``config=``.

The seed block rotates interleaved RoPE pairs, so imports use
``rope_style='interleaved'``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

from eae_jax.blocks import BlockConfig, check_block_params
from interop.errors import CheckpointMismatchError, UnknownFormatError, UnsupportedConfigError
from interop.imported import ImportedBlocks
from interop.layout import SEED_STACK, block_shapes, check_tensors, stack_blocks, unstack_blocks
from interop.safe_load import load_torch_file, state_dict_to_numpy
from interop.tensors import numpy_to_torch, require_torch, resolve_dtype, torch_to_numpy


def _reference_block_class():
    from eae_runtime.contrib import PreNormTransformerBlock

    return PreNormTransformerBlock


def _seed_rope_tables(head_dim: int, max_seq_len: int, theta: float):
    """cos/sin tables exactly as the seed's RotaryPositionalEmbedding builds them (float32 torch)."""
    from eae_runtime.contrib import RotaryPositionalEmbedding

    rope = RotaryPositionalEmbedding(head_dim, max_seq_len, base=theta)
    return rope.cos_cached, rope.sin_cached


def infer_rope_theta(cos: Any, sin: Any, head_dim: int, where: str = "block") -> float:
    """Recover the RoPE base from a reference block's cos/sin buffers and verify it.

    The angle at position p of frequency j is ``p * theta ** (-2j / head_dim)``;
    the base is estimated from it (second and last frequency, refined over
    positions 1, 2, 4, ...). Candidates are 10000, the estimates rounded to
    1, 2, ... significant digits, and the raw estimates; the one whose rebuilt
    tables are closest to the buffers wins (the simplest on a tie), and only if
    it reproduces them to the buffers' own precision.

    Args:
      cos, sin: torch tensors ``(max_seq_len, head_dim // 2)``.
      head_dim: the attention head width.
      where: name used in messages.

    Returns:
      The base (10000.0 when ``head_dim == 2`` or the tables have one row: every base
      gives the same tables then).

    Raises:
      UnsupportedConfigError: the tables are not plain RoPE tables of any base.

    Example:
      >>> from eae_runtime.contrib import RotaryPositionalEmbedding
      >>> from interop.torch_blocks import infer_rope_theta
      >>> rope = RotaryPositionalEmbedding(16, 64, base=500000.0)
      >>> infer_rope_theta(rope.cos_cached, rope.sin_cached, head_dim=16)
      500000.0
    """
    torch = require_torch()
    seq = cos.shape[0]
    if head_dim == 2 or seq < 2:
        # One frequency (always 1) or one position (angle 0): every base gives the same tables.
        return 10000.0
    c = cos.detach().double().cpu()
    s = sin.detach().double().cpu()
    # Estimate the base from the angle at position 1 of the second and of the last frequency
    # (theta ** (-2j / head_dim)); the last one is the better-conditioned estimate.
    estimates = []
    for j in sorted({1, head_dim // 2 - 1}):
        freq = math.atan2(float(s[1, j]), float(c[1, j]))
        if not freq > 0:
            continue
        estimates.append(freq ** (-head_dim / (2.0 * j)))
        # Refine at positions 2, 4, 8 ...: the angle grows while the table's rounding error does not
        # (each step unwraps with the previous estimate, whose error is far below pi there).
        pos = 2
        while pos < seq:
            raw = math.atan2(float(s[pos, j]), float(c[pos, j]))
            freq = (raw + 2 * math.pi * round((pos * freq - raw) / (2 * math.pi))) / pos
            pos *= 2
        if freq > 0:
            estimates.append(freq ** (-head_dim / (2.0 * j)))
    if not estimates:
        raise UnsupportedConfigError(f"{where}: RoPE tables are not increasing rotations")
    # Candidates, simplest first: the default base, then each estimate rounded to 1, 2, ... significant
    # digits (a low-precision bf16/fp16 table pins theta only to a few digits), then the raw estimates.
    candidates = [10000.0]
    for raw in estimates:
        candidates += [float(f"{raw:.{digits}g}") for digits in range(1, 10)] + [raw]
    candidates = list(dict.fromkeys(candidates))
    tol = 0.0 if cos.dtype == torch.float32 else float(torch.finfo(cos.dtype).eps)
    best, best_err = None, math.inf
    for cand in candidates:
        rc, rs = _seed_rope_tables(head_dim, seq, cand)
        rc, rs = rc.to(cos.dtype), rs.to(sin.dtype)
        err = max(float((rc.double() - c).abs().max()), float((rs.double() - s).abs().max()))
        if err < best_err:  # strict: on a tie the simpler (earlier) candidate stays
            best, best_err = cand, err
    if best_err <= tol * 2 + 1e-7:
        return best
    raise UnsupportedConfigError(
        f"{where}: its RoPE cos/sin buffers are not the standard tables of any base near {estimates[-1]:.6g} "
        "(rope scaling or edited buffers are not supported)")


def block_config_from_modules(blocks: Sequence[Any], compute_dtype: Any = None) -> BlockConfig:
    """Read a `BlockConfig` off a list of reference blocks (all must agree).

    Raises:
      UnknownFormatError: an item is not an eae_runtime PreNormTransformerBlock.
      UnsupportedConfigError: RoPE disabled, different eps in the two norms,
        or blocks that disagree with each other.

    Example:
      >>> from eae_runtime.contrib import PreNormTransformerBlock
      >>> from interop.torch_blocks import block_config_from_modules
      >>> cfg = block_config_from_modules([PreNormTransformerBlock(16, 4, num_kv_heads=2, max_seq_len=32, norm_eps=1e-5)])
      >>> cfg.num_kv_heads, cfg.norm_eps, cfg.max_seq_len, cfg.rope_theta, cfg.rope_style
      (2, 1e-05, 32, 10000.0, 'interleaved')
    """
    cls = _reference_block_class()
    if len(blocks) == 0:
        raise UnknownFormatError("an empty block list has nothing to import")
    configs = []
    for i, b in enumerate(blocks):
        if not isinstance(b, cls):
            raise UnknownFormatError(
                f"block {i} is a {type(b).__module__}.{type(b).__name__}, not an "
                "eae_runtime.contrib.PreNormTransformerBlock")
        attn = b.attn
        if attn.rope is None:
            raise UnsupportedConfigError(f"block {i}: attention without RoPE (rope=False) is not supported by eae_jax blocks")
        if b.attn_norm.eps != b.ffn_norm.eps:
            raise UnsupportedConfigError(f"block {i}: attn_norm eps {b.attn_norm.eps} != ffn_norm eps {b.ffn_norm.eps}")
        if attn.dropout:
            warnings.warn(f"block {i} has attention dropout {attn.dropout}; eae_jax blocks have no dropout "
                          "(it only acts in training mode)", stacklevel=3)
        dim = b.attn_norm.weight.shape[0]
        theta = infer_rope_theta(attn.rope.cos_cached, attn.rope.sin_cached, attn.head_dim, f"block {i}")
        configs.append(dict(
            dim=int(dim), num_heads=int(attn.num_heads), num_kv_heads=int(attn.num_kv_heads),
            ffn_hidden_dim=int(b.ffn.gate_proj.out_features), norm_eps=float(b.attn_norm.eps), rope_theta=theta,
            rope_style="interleaved", max_seq_len=int(attn.rope.cos_cached.shape[0]),
        ))
    diffs = [f"block {i}: {c} differs from block 0: {configs[0]}" for i, c in enumerate(configs) if c != configs[0]]
    if diffs:
        raise UnsupportedConfigError("blocks of one stack must share a configuration:\n  " + "\n  ".join(diffs))
    return BlockConfig(**configs[0], compute_dtype=compute_dtype)


def _as_block_list(source: Any) -> Optional[list]:
    torch = require_torch()
    if isinstance(source, (torch.nn.ModuleList, torch.nn.Sequential)):
        return list(source)
    if isinstance(source, (list, tuple)) and source and all(isinstance(m, torch.nn.Module) for m in source):
        return list(source)
    if isinstance(source, torch.nn.Module) and isinstance(source, _reference_block_class()):
        return [source]
    return None


def _depth_from_keys(keys) -> int:
    layers = set()
    for k in keys:
        head = k.split(".", 1)[0]
        if head.isdigit():
            layers.add(int(head))
    if not layers:
        raise UnknownFormatError(
            "the state dict has no keys of the form '<layer>.attn.q_proj.weight'; it is not a "
            "PreNormTransformerBlock stack state dict")
    return max(layers) + 1


def import_seed_blocks(source: Any, config: Optional[BlockConfig] = None, *, depth: Optional[int] = None,
                       dtype: Any = None) -> ImportedBlocks:
    """Import a PreNormTransformerBlock stack into stacked eae_jax block params.

    Args:
      source: ``nn.ModuleList`` / ``nn.Sequential`` / list of reference
        blocks, a state dict of such a ModuleList (keys
        ``'<i>.attn.q_proj.weight'`` ...), or a path to a ``.pt`` holding either
        (read with the weights-only unpickler).
      config: required for a state dict (it does not record heads, eps, RoPE);
        with modules it is read from them, and a given config must agree.
      depth: expected number of blocks for a state dict (default: highest
        layer index + 1), so a missing last layer is caught too.
      dtype: convert every tensor to this dtype; None keeps the stored dtypes.

    Returns:
      `ImportedBlocks` (params, config, depth, meta).

    Raises:
      CheckpointMismatchError: missing / unexpected / mis-shaped tensors, all listed.
      UnknownFormatError, UnsupportedConfigError, UnsafeCheckpointError,
      CorruptCheckpointError: see the messages.
      ValueError: no config for a state dict, or a config contradicting the modules.

    Example:
      >>> import torch
      >>> from eae_runtime.contrib import PreNormTransformerBlock
      >>> from interop import import_seed_blocks
      >>> blocks = torch.nn.ModuleList(PreNormTransformerBlock(16, 2, max_seq_len=8) for _ in range(2))
      >>> imported = import_seed_blocks(blocks)
      >>> imported.depth, imported.params["ffn"]["w_gate"].shape
      (2, (2, 256, 16))
      >>> from_dict = import_seed_blocks(blocks.state_dict(), imported.config)     # a bare state dict needs the config
      >>> bool((from_dict.params["attn"]["wq"] == imported.params["attn"]["wq"]).all())
      True
    """
    where = "PreNormTransformerBlock stack"
    meta = {"format": "eae_runtime_blocks"}
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        where = path
        meta["source"] = path
        source = load_torch_file(path, allow_modules=True)
    blocks = _as_block_list(source)
    want_dtype = resolve_dtype(dtype)
    if blocks is not None:
        found = block_config_from_modules(blocks, compute_dtype=None)
        if config is not None and _config_key(config) != _config_key(found):
            raise ValueError(f"{where}: the given config {config} contradicts the modules, which say {found}")
        config = config or found
        depth_found = len(blocks)
        if depth is not None and depth != depth_found:
            raise CheckpointMismatchError(where, other=[f"expected {depth} blocks, the stack has {depth_found}"])
        depth = depth_found
        tensors = {}
        for i, b in enumerate(blocks):
            for k, v in b.state_dict().items():
                tensors[f"{i}.{k}"] = torch_to_numpy(v)
    elif isinstance(source, Mapping):
        tensors = state_dict_to_numpy(dict(source), where)
        if config is None:
            raise ValueError(
                f"{where}: a bare state dict does not record num_heads, num_kv_heads, norm eps or the RoPE base; "
                "pass config=BlockConfig(...) (or import the nn.ModuleList itself)")
        if config.rope_style != "interleaved":
            # The seed block always rotates interleaved pairs; these weights under 'half' compute another model.
            raise UnsupportedConfigError(
                f"{where}: PreNormTransformerBlock weights use interleaved RoPE, but the given config has "
                f"rope_style={config.rope_style!r}; pass rope_style='interleaved'")
        depth = depth if depth is not None else _depth_from_keys(tensors)
    else:
        raise UnknownFormatError(
            f"{where}: cannot import a {type(source).__name__}; expected an nn.ModuleList of "
            "PreNormTransformerBlock, its state_dict(), or a .pt path")
    expected = {}
    per = block_shapes(SEED_STACK.block, config)
    for i in range(depth):
        expected.update({f"{i}.{k}": s for k, s in per.items()})
    check_tensors(tensors, expected, where, ignore=SEED_STACK.ignore)
    params = stack_blocks(tensors, SEED_STACK, depth, want_dtype, where)
    check_block_params(params, config, leading=(depth,))
    meta["dtypes"] = sorted({str(v.dtype) for v in tensors.values()})
    return ImportedBlocks(params, config, depth, meta)


def _config_key(cfg: BlockConfig) -> tuple:
    return (cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_dim, cfg.norm_eps, cfg.rope_theta,
            cfg.rope_style, cfg.max_seq_len)


def seed_state_dict(params: Mapping[str, Any], config: BlockConfig) -> "OrderedDict[str, Any]":
    """Stacked eae_jax block params -> a ModuleList state dict (``'<i>.attn.q_proj.weight'`` ...).

    Every tensor keeps its dtype and bits.

    Raises:
      ValueError: params do not match ``config``.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig, init_stack
      >>> from interop import seed_state_dict
      >>> cfg = BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16)
      >>> sd = seed_state_dict(init_stack(jax.random.key(0), cfg, depth=2), cfg)
      >>> list(sd)[:2], sd["1.ffn.gate_proj.weight"].shape
      (['0.attn_norm.weight', '0.attn.q_proj.weight'], torch.Size([16, 8]))
    """
    depth = _stack_depth(params)
    check_block_params(params, config, leading=(depth,))
    flat = unstack_blocks(params, SEED_STACK, depth)
    return OrderedDict((k, numpy_to_torch(v)) for k, v in flat.items())


def _stack_depth(params) -> int:
    import jax

    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or getattr(leaves[0], "ndim", 0) < 1:
        raise ValueError("expected stacked block params with a leading depth axis")
    return int(leaves[0].shape[0])


def export_seed_blocks(params: Mapping[str, Any], config: BlockConfig) -> Any:
    """Build an ``nn.ModuleList`` of PreNormTransformerBlock holding these params.

    The modules get ``config``'s eps, max_seq_len and RoPE base (the RoPE
    buffers are rebuilt with the seed's own class when the base is not
    10000). Parameters are assigned, not copied into float32 modules, so
    their dtypes and bits are kept.

    Raises:
      UnsupportedConfigError: ``rope_style='half'`` (the seed block only
        implements interleaved RoPE).
      ValueError: params do not match ``config``.

    Example:
      >>> import jax, numpy as np, torch
      >>> from eae_jax.blocks import BlockConfig, decoder_block, init_stack, plain_stack
      >>> from interop import export_seed_blocks
      >>> cfg = BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=8)
      >>> params = init_stack(jax.random.key(0), cfg, depth=2)
      >>> blocks = export_seed_blocks(params, cfg)                 # nn.ModuleList of PreNormTransformerBlock
      >>> x = np.random.default_rng(0).standard_normal((1, 8, 8)).astype(np.float32)
      >>> with torch.no_grad():
      ...     y_torch = blocks[1](blocks[0](torch.from_numpy(x))).numpy()
      >>> bool(np.allclose(y_torch, plain_stack(decoder_block(cfg), params, x), atol=1e-5))
      True
    """
    torch = require_torch()
    if config.rope_style != "interleaved":
        raise UnsupportedConfigError(
            "PreNormTransformerBlock rotates interleaved RoPE pairs; params of a rope_style='half' model "
            "cannot be exported to it unchanged")
    cls = _reference_block_class()
    sd = seed_state_dict(params, config)
    depth = _stack_depth(params)
    blocks = torch.nn.ModuleList()
    for i in range(depth):
        b = cls(config.dim, config.num_heads, num_kv_heads=config.num_kv_heads, max_seq_len=config.max_seq_len,
                ffn_hidden_dim=config.ffn_hidden_dim, norm_eps=config.norm_eps)
        if config.rope_theta != 10000.0:
            from eae_runtime.contrib import RotaryPositionalEmbedding

            b.attn.rope = RotaryPositionalEmbedding(config.head_dim, config.max_seq_len, base=config.rope_theta)
        prefix = f"{i}."
        b.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, strict=True, assign=True)
        blocks.append(b.eval())
    return blocks


def save_seed_blocks(path: str, params: Mapping[str, Any], config: BlockConfig) -> None:
    """Write the stack as ``torch.save(nn.ModuleList)``: loadable by `import_seed_blocks`
    (weights-only, with the reference classes allowlisted) and by plain torch.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.blocks import BlockConfig, init_stack
      >>> from interop import import_seed_blocks, save_seed_blocks
      >>> cfg = BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, max_seq_len=8)
      >>> path = os.path.join(tempfile.mkdtemp(), "blocks.pt")
      >>> save_seed_blocks(path, init_stack(jax.random.key(0), cfg, depth=2), cfg)
      >>> imported = import_seed_blocks(path)
      >>> imported.depth, imported.config == cfg
      (2, True)
    """
    torch = require_torch()
    torch.save(export_seed_blocks(params, config), path)


def block_param_name(i: int, torch_key: str) -> str:
    """Parity name of a reference block parameter: ``blocks.<i>.<group>.<leaf>``.

    Example:
      >>> from interop.torch_blocks import block_param_name
      >>> block_param_name(3, "ffn.gate_proj.weight")
      'blocks.3.ffn.w_gate'
    """
    a, b = SEED_STACK.block.keys[torch_key]
    return f"blocks.{i}.{a}.{b}"
