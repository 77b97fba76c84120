"""Hugging Face LLaMA checkpoints <-> eae_jax LM params.

A checkpoint is a directory with ``config.json`` and the weights as
``model.safetensors``, ``pytorch_model.bin`` (a torch pickle, read
weights-only) or their sharded ``*.index.json`` forms. Tensor names:
``model.embed_tokens.weight``, ``model.layers.N.self_attn.{q,k,v,o}_proj.weight``,
``model.layers.N.mlp.{gate,up,down}_proj.weight``,
``model.layers.N.input_layernorm.weight``,
``model.layers.N.post_attention_layernorm.weight``, ``model.norm.weight``,
``lm_head.weight`` (absent when ``tie_word_embeddings``).

RoPE: Hugging Face LLaMA rotates the two halves of each head
(``rotate_half``), not interleaved pairs. The q/k weights are taken as
they are and the JAX blocks run with ``rope_style='half'``; no rows are
permuted. Config fields read: hidden_size, num_attention_heads,
num_key_value_heads, intermediate_size, num_hidden_layers, vocab_size,
rms_norm_eps, rope_theta (``rope_parameters`` in transformers 5),
max_position_embeddings, tie_word_embeddings. Features the JAX blocks do not
implement (biases, rope scaling, another activation, a head_dim that is not
hidden/heads) are refused with `UnsupportedConfigError`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional

import numpy as np

from eae_jax.blocks import BlockConfig
from eae_jax.models import LMConfig
from interop.errors import CorruptCheckpointError, InteropError, UnknownFormatError, UnsupportedConfigError
from interop.imported import ImportedModel
from interop.layout import HF_LM, lm_params_from_tensors, lm_tensors_from_params
from interop.safe_load import (atomic_target, detect_format, load_safetensors_file, load_torch_file, read_json,
                               state_dict_to_numpy)
from interop.tensors import numpy_to_torch, require_torch, resolve_dtype

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


def _rope(config: Mapping[str, Any]):
    """(theta, rope_type, extra keys) from either the v5 ``rope_parameters`` or the v4 fields."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, Mapping):
            # transformers refuses these too (its config validation wants a dict of RoPE parameters)
            raise UnsupportedConfigError(f"config {key} must be a dict of RoPE parameters or null, got "
                                         f"{type(value).__name__} {value!r}")
    if isinstance(scaling, Mapping) and scaling and isinstance(params, Mapping) and params:
        # transformers 5 lets a (v4-style) rope_scaling override rope_parameters (``rope_scaling or
        # rope_parameters``); reading rope_parameters alone would silently drop the scaling.
        params = {**scaling, "rope_theta": scaling.get("rope_theta", params.get("rope_theta"))}
        if params["rope_theta"] is None:
            del params["rope_theta"]
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        extra = sorted(k for k in params if k not in ("rope_theta", "rope_type", "type"))
        return float(theta), rope_type, extra
    scaling = config.get("rope_scaling")
    rope_type = "default"
    extra = []
    if isinstance(scaling, Mapping) and scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        extra = sorted(k for k in scaling if k not in ("rope_type", "type"))
    return float(config.get("rope_theta", 10000.0)), rope_type, extra


def lm_config_from_hf(config: Any, compute_dtype: Any = None) -> LMConfig:
    """`LMConfig` (``rope_style='half'``) from a Hugging Face LLaMA config.

    Args:
      config: a config.json dict or a ``transformers.LlamaConfig``.
      compute_dtype: forwarded to the `BlockConfig`.

    Raises:
      UnsupportedConfigError: not a LLaMA config, or a feature the JAX blocks
        lack (the message lists every one found).

    Example:
      >>> from interop import lm_config_from_hf
      >>> hf = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
      ...       "num_hidden_layers": 2, "vocab_size": 100, "rope_theta": 500000.0}
      >>> cfg = lm_config_from_hf(hf)
      >>> cfg.block.rope_style, cfg.block.rope_theta, cfg.block.num_kv_heads, cfg.tie_embeddings
      ('half', 500000.0, 2, False)
      >>> lm_config_from_hf({**hf, "attention_bias": True, "hidden_act": "gelu"})
      Traceback (most recent call last):
      ...
      interop.errors.UnsupportedConfigError: unsupported Hugging Face LLaMA config:
        hidden_act 'gelu' (only silu / SwiGLU)
        attention_bias=True (eae_jax blocks have no biases)
    """
    if not isinstance(config, Mapping):
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        else:
            raise UnknownFormatError(f"expected a config dict or LlamaConfig, got {type(config).__name__}")
    problems = []
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        problems.append(f"model_type {model_type!r} (only 'llama' is supported)")
    need = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")
    missing = [k for k in need if config.get(k) is None]
    if missing:
        raise UnsupportedConfigError(f"Hugging Face config lacks {missing}")
    dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    if config.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: swish is silu
        problems.append(f"hidden_act {config.get('hidden_act')!r} (only silu / SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            problems.append(f"{flag}=True (eae_jax blocks have no biases)")
    head_dim = config.get("head_dim")
    if head_dim is not None and dim % heads == 0 and int(head_dim) != dim // heads:
        problems.append(f"head_dim {head_dim} != hidden_size / num_attention_heads = {dim // heads}")
    elif dim % heads:
        problems.append(f"hidden_size {dim} is not a multiple of num_attention_heads {heads} (head_dim "
                        f"{head_dim}); eae_jax blocks need head_dim = hidden_size / num_attention_heads")
    theta, rope_type, extra = _rope(config)
    if rope_type not in (None, "default"):
        problems.append(f"rope type {rope_type!r} with {extra} (only unscaled RoPE is supported)")
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(f"partial_rotary_factor {config.get('partial_rotary_factor')}")
    if problems:
        raise UnsupportedConfigError("unsupported Hugging Face LLaMA config:\n  " + "\n  ".join(problems))
    try:
        block = BlockConfig(
            dim=dim, num_heads=heads, num_kv_heads=kv, ffn_hidden_dim=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_style="half",
            max_seq_len=int(config.get("max_position_embeddings", 2048)), compute_dtype=compute_dtype,
        )
    except ValueError as err:  # heads not divisible by kv heads, odd head_dim ...
        raise UnsupportedConfigError(f"unsupported Hugging Face LLaMA config: {err}") from None
    return LMConfig(vocab_size=int(config["vocab_size"]), depth=int(config["num_hidden_layers"]), block=block,
                    tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def hf_config_from_lm(cfg: LMConfig, base: Optional[Mapping[str, Any]] = None, dtype: Any = None) -> Dict[str, Any]:
    """A config.json dict for ``cfg``. Fields of ``base`` (e.g. the imported
    original: token ids, transformers_version) are kept; the architecture
    fields are overwritten from ``cfg``; ``dtype`` (the weights' dtype), when
    given, is recorded as transformers does.

    Raises:
      UnsupportedConfigError: ``cfg`` uses interleaved RoPE (HF LLaMA rotates halves).

    Example:
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig
      >>> from interop import hf_config_from_lm
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, rope_style="half"))
      >>> config = hf_config_from_lm(cfg)
      >>> config["model_type"], config["hidden_size"], config["intermediate_size"], config["tie_word_embeddings"]
      ('llama', 8, 16, False)
    """
    b = cfg.block
    if b.rope_style != "half":
        raise UnsupportedConfigError(
            "Hugging Face LLaMA rotates half-split RoPE pairs; this model uses rope_style='interleaved' "
            "and would compute something else under HF's code")
    out = dict(base or {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                        "attention_bias": False, "mlp_bias": False})
    out.update(hidden_size=b.dim, num_attention_heads=b.num_heads, num_key_value_heads=b.num_kv_heads,
               intermediate_size=b.ffn_hidden_dim, num_hidden_layers=cfg.depth, vocab_size=cfg.vocab_size,
               rms_norm_eps=b.norm_eps, max_position_embeddings=b.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
               head_dim=b.head_dim)
    if isinstance(out.get("rope_parameters"), Mapping) or base is None:
        out["rope_parameters"] = {**dict(out.get("rope_parameters") or {}), "rope_type": "default", "rope_theta": b.rope_theta}
    if "rope_theta" in out or base is None or not isinstance(out.get("rope_parameters"), Mapping):
        out["rope_theta"] = b.rope_theta  # also for a base that recorded no RoPE base at all
    if dtype is not None:
        # transformers 5 writes "dtype", 4.x "torch_dtype"; update whichever the base uses.
        out["torch_dtype" if "torch_dtype" in out and "dtype" not in out else "dtype"] = np.dtype(dtype).name
    return out


def import_hf_state_dict(state_dict: Mapping[str, Any], config: Any, *, dtype: Any = None,
                         where: str = "Hugging Face LLaMA state dict") -> ImportedModel:
    """Import a LLaMA state dict (torch tensors or numpy arrays) with its config.

    A tied model may include ``lm_head.weight`` (``model.state_dict()`` does);
    it must equal the embedding. Non-persistent RoPE ``inv_freq`` buffers of
    old exports are skipped; any other unknown name is an error.

    Raises:
      UnsupportedConfigError: see `lm_config_from_hf`.
      CheckpointMismatchError: every missing / unexpected / mis-shaped tensor.

    Example:
      >>> import jax
      >>> from eae_jax.models import init_lm
      >>> from interop import hf_state_dict, import_hf_state_dict, lm_config_from_hf
      >>> config = {"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "num_hidden_layers": 1,
      ...        "vocab_size": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 16}
      >>> cfg = lm_config_from_hf(config)
      >>> state_dict = hf_state_dict(init_lm(jax.random.key(0), cfg), cfg)
      >>> imported = import_hf_state_dict(state_dict, config)
      >>> sorted(imported.params), imported.config == cfg
      (['blocks', 'embed', 'final_norm', 'lm_head'], True)
    """
    if not isinstance(config, Mapping) and hasattr(config, "to_dict"):
        config = config.to_dict()
    cfg = lm_config_from_hf(config)
    tensors = state_dict_to_numpy(dict(state_dict), where)
    params = lm_params_from_tensors(tensors, cfg, HF_LM, resolve_dtype(dtype), where)
    meta = {"format": "hf_llama", "config": dict(config), "dtypes": sorted({str(v.dtype) for v in tensors.values()}),
            "has_tied_head_tensor": cfg.tie_embeddings and HF_LM.head in tensors}
    return ImportedModel(params, cfg, meta)


def import_hf_model(model: Any, *, dtype: Any = None) -> ImportedModel:
    """Import a live ``transformers`` LlamaForCausalLM (its state_dict and config).

    Example:
      >>> import torch
      >>> from transformers import LlamaConfig, LlamaForCausalLM
      >>> from interop import import_hf_model
      >>> _ = torch.manual_seed(0)
      >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=8, num_attention_heads=2, intermediate_size=16,
      ...                                      num_hidden_layers=1, vocab_size=32, max_position_embeddings=16))
      >>> imported = import_hf_model(model)
      >>> imported.config.depth, imported.config.block.rope_style, imported.params["blocks"]["attn"]["wq"].shape
      (1, 'half', (1, 8, 8))
    """
    return import_hf_state_dict(model.state_dict(), model.config.to_dict(), dtype=dtype,
                                where=f"{type(model).__name__} state dict")


def _load_weight_file(path: str) -> Dict[str, np.ndarray]:
    """The tensors of one weights file, safetensors or torch pickle told apart by content (not the suffix)."""
    fmt = detect_format(path)
    if fmt == "safetensors":
        return load_safetensors_file(path)
    if fmt == "torch_pickle":
        return state_dict_to_numpy(load_torch_file(path), path)
    raise UnknownFormatError(f"{path}: a weights file must be safetensors or a torch pickle, found {fmt}")


def _load_weights(directory: str) -> Dict[str, np.ndarray]:
    st, st_index = os.path.join(directory, SAFETENSORS_NAME), os.path.join(directory, SAFETENSORS_INDEX)
    pt, pt_index = os.path.join(directory, TORCH_NAME), os.path.join(directory, TORCH_INDEX)
    if os.path.isfile(st):
        return load_safetensors_file(st)
    if os.path.isfile(st_index) or os.path.isfile(pt_index):
        index_path = st_index if os.path.isfile(st_index) else pt_index
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CorruptCheckpointError(f"{index_path}: no 'weight_map' object")
        out: Dict[str, np.ndarray] = {}
        where_from: Dict[str, str] = {}
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
                # The index is data: it must not point outside the checkpoint directory.
                raise CorruptCheckpointError(f"{index_path}: shard name {shard!r} is not a file inside {directory}")
            shard_path = os.path.join(directory, shard)
            if not os.path.isfile(shard_path):
                raise CorruptCheckpointError(f"{index_path} names shard {shard!r}, which is missing")
            part = _load_weight_file(shard_path)
            twice = sorted(k for k in part if k in out)
            if twice:
                raise CorruptCheckpointError(
                    f"{index_path}: tensor(s) {twice[:8]} are in both {where_from[twice[0]]!r} and {shard!r}; "
                    "which one is meant is ambiguous")
            where_from.update({k: shard for k in part})
            out.update(part)
        return out
    if os.path.isfile(pt):
        return state_dict_to_numpy(load_torch_file(pt), pt)
    raise UnknownFormatError(
        f"{directory}: no {SAFETENSORS_NAME}, {SAFETENSORS_INDEX}, {TORCH_NAME} or {TORCH_INDEX} next to config.json")


def load_hf(path: str, *, dtype: Any = None) -> ImportedModel:
    """Import a Hugging Face LLaMA checkpoint.

    Args:
      path: the checkpoint directory, or one weights file (``.safetensors`` /
        ``.bin``) with ``config.json`` beside it.
      dtype: convert every tensor to it; None keeps the stored dtypes.

    Raises:
      FileNotFoundError, UnknownFormatError, CorruptCheckpointError,
      UnsafeCheckpointError, UnsupportedConfigError, CheckpointMismatchError.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop import lm_config_from_hf, load_hf, save_hf
      >>> cfg = lm_config_from_hf({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "num_hidden_layers": 1,
      ...                         "vocab_size": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 16})
      >>> folder = tempfile.mkdtemp()
      >>> save_hf(folder, init_lm(jax.random.key(0), cfg), cfg)
      >>> imported = load_hf(folder)
      >>> imported.meta["format"], imported.config == cfg
      ('hf_llama', True)
    """
    if os.path.isdir(path):
        directory = path
        tensors = None
    elif os.path.isfile(path):
        directory = os.path.dirname(os.path.abspath(path))
        tensors = _load_weight_file(path)
    else:
        raise FileNotFoundError(f"no such checkpoint file or directory: {path}")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise UnknownFormatError(f"{path}: a Hugging Face checkpoint needs config.json in {directory}")
    config = read_json(config_path)
    if tensors is None:
        tensors = _load_weights(directory)
    imported = import_hf_state_dict(tensors, config, dtype=dtype, where=path)
    imported.meta["source"] = path
    return imported


def hf_state_dict(params: Mapping[str, Any], cfg: LMConfig, *, tied_head: bool = False) -> Dict[str, Any]:
    """eae_jax LM params -> HF LLaMA state dict of torch tensors (dtypes and bits kept).

    Args:
      tied_head: for a tied model also emit ``lm_head.weight`` (as
        ``model.state_dict()`` does); ``save_pretrained`` files omit it.

    Example:
      >>> import jax
      >>> from eae_jax.blocks import BlockConfig
      >>> from eae_jax.models import LMConfig, init_lm
      >>> from interop import hf_state_dict
      >>> block = BlockConfig(dim=8, num_heads=2, ffn_hidden_dim=16, rope_style="half")
      >>> cfg = LMConfig(vocab_size=32, depth=1, block=block, tie_embeddings=True)
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> "lm_head.weight" in hf_state_dict(params, cfg), "lm_head.weight" in hf_state_dict(params, cfg, tied_head=True)
      (False, True)
    """
    flat = lm_tensors_from_params(params, cfg, HF_LM, tied_head=False)
    out = {k: numpy_to_torch(v) for k, v in flat.items()}
    if cfg.tie_embeddings and tied_head:
        out[HF_LM.head] = out[HF_LM.embed]
    return out


def save_hf(directory: str, params: Mapping[str, Any], cfg: LMConfig, *, weights: str = "safetensors",
            base_config: Optional[Mapping[str, Any]] = None) -> None:
    """Write a Hugging Face checkpoint directory: config.json + weights.

    Args:
      weights: ``'safetensors'`` (model.safetensors) or ``'bin'``
        (pytorch_model.bin, a torch pickle of the state dict).
      base_config: config.json fields to keep (``meta['config']`` of an import).

    Raises:
      ValueError: unknown ``weights`` kind, or params that do not match ``cfg``.
      UnsupportedConfigError: interleaved-RoPE model.
      InteropError: ``weights='bin'`` into a directory holding a
        model.safetensors or a shard index, which loaders would read instead.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop import lm_config_from_hf, save_hf
      >>> cfg = lm_config_from_hf({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "num_hidden_layers": 1,
      ...                         "vocab_size": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 16})
      >>> folder = tempfile.mkdtemp()
      >>> save_hf(folder, init_lm(jax.random.key(0), cfg), cfg)
      >>> sorted(os.listdir(folder))
      ['config.json', 'model.safetensors']
      >>> save_hf(folder, init_lm(jax.random.key(0), cfg), cfg, weights="bin")
      Traceback (most recent call last):
      ...
      interop.errors.InteropError: ... already holds ['model.safetensors'], which loaders read before
      pytorch_model.bin: the exported weights would be shadowed. ...
    """
    if weights not in ("safetensors", "bin"):
        raise ValueError(f"weights must be 'safetensors' or 'bin', got {weights!r}")
    config = hf_config_from_lm(cfg, base_config, dtype=np.asarray(params["embed"]).dtype)
    sd = hf_state_dict(params, cfg)
    if weights == "bin":
        # Loaders (ours and transformers') read these before pytorch_model.bin: left in place they would
        # silently shadow the new weights. Refused rather than deleted: they may be the only copy.
        shadowing = [n for n in (SAFETENSORS_NAME, SAFETENSORS_INDEX, TORCH_INDEX)
                     if os.path.isfile(os.path.join(directory, n))]
        if shadowing:
            raise InteropError(
                f"{directory} already holds {shadowing}, which loaders read before {TORCH_NAME}: the exported "
                "weights would be shadowed. Export into another directory, remove those files, or use "
                "weights='safetensors' (nothing written)")
    os.makedirs(directory, exist_ok=True)
    # Each file lands by one rename: a failure halfway leaves the earlier files whole.
    if weights == "safetensors":
        from safetensors.torch import save_file

        with atomic_target(os.path.join(directory, SAFETENSORS_NAME)) as tmp:
            save_file({k: v.contiguous() for k, v in sd.items()}, tmp, metadata={"format": "pt"})
    else:
        with atomic_target(os.path.join(directory, TORCH_NAME)) as tmp:
            require_torch().save(sd, tmp)
    with atomic_target(os.path.join(directory, "config.json")) as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def to_transformers(params: Mapping[str, Any], cfg: LMConfig, base_config: Optional[Mapping[str, Any]] = None) -> Any:
    """Build a ``transformers.LlamaForCausalLM`` holding these params (needs transformers).

    Parameters are assigned, so they keep their dtype and bits.

    Example:
      >>> import jax, numpy as np, torch
      >>> from eae_jax.models import init_lm, lm_apply
      >>> from interop import lm_config_from_hf, to_transformers
      >>> cfg = lm_config_from_hf({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "num_hidden_layers": 1,
      ...                         "vocab_size": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 16})
      >>> params = init_lm(jax.random.key(0), cfg)
      >>> tokens = np.array([[1, 5, 7]])
      >>> with torch.no_grad():
      ...     hf_logits = to_transformers(params, cfg)(torch.from_numpy(tokens)).logits.numpy()
      >>> bool(np.allclose(hf_logits, lm_apply(params, tokens, cfg), atol=1e-5))
      True
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    sd = hf_state_dict(params, cfg, tied_head=cfg.tie_embeddings)
    config = LlamaConfig.from_dict(hf_config_from_lm(cfg, base_config))
    model = LlamaForCausalLM(config)
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
