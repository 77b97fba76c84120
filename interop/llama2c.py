"""llama2.c checkpoints <-> eae_jax LM params.

Two file kinds:

* the PyTorch training checkpoint (``ckpt.pt``): a dict with ``model_args``
  (dim, n_layers, n_heads, n_kv_heads, vocab_size, hidden_dim, multiple_of,
  norm_eps, max_seq_len, dropout) and ``model`` (the Transformer's state dict:
  ``tok_embeddings.weight``, ``layers.N.attention.wq.weight`` ...,
  ``layers.N.feed_forward.w1/w2/w3.weight``, ``layers.N.attention_norm.weight``,
  ``layers.N.ffn_norm.weight``, ``norm.weight``, ``output.weight``). llama2.c
  always ties ``output.weight`` to the embedding; both keys are stored.
* the exported ``.bin``: legacy version 0 (7 int32 header, float32 tensors
  each stacked over layers, then the RoPE cos/sin tables; a negative
  vocab_size flags an untied classifier stored last) and version 1 (256-byte
  header with magic ``ak42``, no RoPE tables). Version 2 (Q8_0) is refused.

llama2.c rotates interleaved RoPE pairs with base 10000, so imports use
``rope_style='interleaved'``. Every matrix is stored ``(out, in)`` like
eae_jax, so values are moved without transposes.
"""

from __future__ import annotations

import struct
from typing import Any, Dict, Mapping, Optional

import numpy as np

from eae_jax.blocks import BlockConfig, default_ffn_hidden_dim
from eae_jax.models import LMConfig
from interop.errors import CorruptCheckpointError, UnknownFormatError, UnsupportedConfigError
from interop.imported import ImportedModel
from interop.layout import LLAMA2C_LM, lm_params_from_tensors, lm_tensors_from_params
from interop.safe_load import (
    atomic_target,
    LLAMA2C_MAGIC,
    detect_format,
    file_sha256,
    llama2c_bin_size,
    load_torch_file,
    state_dict_to_numpy,
)
from interop.tensors import numpy_to_torch, require_torch, resolve_dtype, same_bits

#: llama2.c's RoPE base (hard-coded in its model.py and run.c).
LLAMA2C_ROPE_THETA = 10000.0
#: The prefix torch.compile adds to state-dict keys; llama2.c strips it on load too.
COMPILE_PREFIX = "_orig_mod."


def lm_config_from_model_args(args: Mapping[str, Any], compute_dtype: Any = None) -> LMConfig:
    """`LMConfig` from llama2.c's ``model_args`` (hidden_dim None -> its multiple_of rule).

    The head is tied (llama2.c's Transformer always ties); importers untie it
    when the checkpoint's ``output.weight`` differs from the embedding.

    Raises:
      UnsupportedConfigError: a required field is missing or not an int.

    Example:
      >>> from interop.llama2c import lm_config_from_model_args
      >>> args = {"dim": 64, "n_layers": 5, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 512, "hidden_dim": 172}
      >>> cfg = lm_config_from_model_args(args)
      >>> cfg.depth, cfg.block.num_kv_heads, cfg.block.rope_style, cfg.block.norm_eps, cfg.tie_embeddings
      (5, 4, 'interleaved', 1e-05, True)
    """
    need = ("dim", "n_layers", "n_heads", "vocab_size")
    missing = [k for k in need if k not in args]
    if missing:
        raise UnsupportedConfigError(f"llama2.c model_args lacks {missing}; got keys {sorted(args)}")
    dim, heads = int(args["dim"]), int(args["n_heads"])
    kv = args.get("n_kv_heads")
    hidden = args.get("hidden_dim")
    if hidden is None:
        hidden = default_ffn_hidden_dim(dim, int(args.get("multiple_of", 256)))
    block = BlockConfig(
        dim=dim, num_heads=heads, num_kv_heads=int(kv) if kv is not None else heads, ffn_hidden_dim=int(hidden),
        norm_eps=float(args.get("norm_eps", 1e-5)), rope_theta=LLAMA2C_ROPE_THETA, rope_style="interleaved",
        max_seq_len=int(args.get("max_seq_len", 2048)), compute_dtype=compute_dtype,
    )
    return LMConfig(vocab_size=int(args["vocab_size"]), depth=int(args["n_layers"]), block=block, tie_embeddings=True)


def model_args_from_config(cfg: LMConfig, base: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """llama2.c ``model_args`` for ``cfg``; fields of ``base`` that ``cfg`` does not
    determine (``multiple_of``, ``dropout``, a None ``hidden_dim`` that the rule
    reproduces) are kept.

    Raises:
      UnsupportedConfigError: a config llama2.c cannot express (half RoPE, base != 10000).

    Example:
      >>> from interop.llama2c import lm_config_from_model_args, model_args_from_config
      >>> cfg = lm_config_from_model_args({"dim": 64, "n_layers": 5, "n_heads": 8, "vocab_size": 512})
      >>> args = model_args_from_config(cfg)
      >>> args["n_layers"], args["n_kv_heads"], args["hidden_dim"], args["dropout"]   # F from the 256 rule
      (5, 8, 256, 0.0)
    """
    b = cfg.block
    if b.rope_style != "interleaved" or b.rope_theta != LLAMA2C_ROPE_THETA:
        raise UnsupportedConfigError(
            f"llama2.c models use interleaved RoPE with base 10000; this model has rope_style={b.rope_style!r}, "
            f"rope_theta={b.rope_theta}")
    out = dict(base or {})
    out.update(dim=b.dim, n_layers=cfg.depth, n_heads=b.num_heads, n_kv_heads=b.num_kv_heads,
               vocab_size=cfg.vocab_size, norm_eps=b.norm_eps, max_seq_len=b.max_seq_len)
    keep_none = base is not None and base.get("hidden_dim") is None and "hidden_dim" in base and \
        default_ffn_hidden_dim(b.dim, int(base.get("multiple_of", 256))) == b.ffn_hidden_dim
    if not keep_none:
        out["hidden_dim"] = b.ffn_hidden_dim
    out.setdefault("multiple_of", 256)
    out.setdefault("dropout", 0.0)
    return out


# --------------------------------------------------------------------------- .pt
def import_llama2c_checkpoint(ckpt: Mapping[str, Any], *, dtype: Any = None, tie_embeddings: Optional[bool] = None,
                              where: str = "llama2.c checkpoint") -> ImportedModel:
    """Import a loaded llama2.c training checkpoint dict (``model_args`` + ``model``).

    Args:
      ckpt: the dict; other entries (optimizer, iter_num, config) are ignored
        (their names are kept in ``meta['other_entries']``).
      dtype: convert every tensor to it; None keeps the stored dtypes.
      tie_embeddings: force tied/untied; None decides from the file: tied
        when ``output.weight`` is absent or bit-identical to the embedding.
      where: name used in messages.

    Raises:
      UnknownFormatError: not such a dict.
      CheckpointMismatchError: missing / unexpected / mis-shaped tensors, all listed.

    Example:
      >>> import jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import (import_llama2c_checkpoint, llama2c_state_dict, lm_config_from_model_args,
      ...                              model_args_from_config)
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> model = llama2c_state_dict(init_lm(jax.random.key(0), cfg), cfg)
      >>> imported = import_llama2c_checkpoint({"model_args": model_args_from_config(cfg), "model": model, "iter_num": 10})
      >>> imported.config.tie_embeddings, imported.meta["other_entries"]
      (True, ['iter_num'])
    """
    if not isinstance(ckpt, Mapping) or "model_args" not in ckpt or "model" not in ckpt:
        got = sorted(ckpt) if isinstance(ckpt, Mapping) else type(ckpt).__name__
        raise UnknownFormatError(f"{where}: a llama2.c checkpoint is a dict with 'model_args' and 'model'; got {got}")
    args = dict(ckpt["model_args"])
    sd = {(k[len(COMPILE_PREFIX):] if k.startswith(COMPILE_PREFIX) else k): v for k, v in ckpt["model"].items()}
    tensors = state_dict_to_numpy(sd, where)
    cfg = lm_config_from_model_args(args)
    if tie_embeddings is None:
        head, emb = tensors.get(LLAMA2C_LM.head), tensors.get(LLAMA2C_LM.embed)
        tie_embeddings = head is None or (emb is not None and same_bits(head, emb))
    cfg = LMConfig(cfg.vocab_size, cfg.depth, cfg.block, tie_embeddings=bool(tie_embeddings))
    params = lm_params_from_tensors(tensors, cfg, LLAMA2C_LM, resolve_dtype(dtype), where)
    meta = {"format": "llama2c_pt", "model_args": args,
            "other_entries": sorted(k for k in ckpt if k not in ("model_args", "model")),
            "dtypes": sorted({str(v.dtype) for v in tensors.values()})}
    return ImportedModel(params, cfg, meta)


def load_llama2c_pt(path: str, *, dtype: Any = None, tie_embeddings: Optional[bool] = None) -> ImportedModel:
    """Read a llama2.c ``.pt`` checkpoint (weights-only unpickler) and import it.

    Raises: see `import_llama2c_checkpoint` and `interop.safe_load.load_torch_file`.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, load_llama2c_pt, save_llama2c_pt
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
      >>> save_llama2c_pt(path, init_lm(jax.random.key(0), cfg), cfg, iter_num=10)
      >>> imported = load_llama2c_pt(path)
      >>> imported.meta["format"], imported.config.depth, imported.meta["other_entries"]
      ('llama2c_pt', 1, ['iter_num'])
    """
    imported = import_llama2c_checkpoint(load_torch_file(path), dtype=dtype, tie_embeddings=tie_embeddings, where=path)
    imported.meta["source"] = path
    return imported


def llama2c_state_dict(params: Mapping[str, Any], cfg: LMConfig) -> Dict[str, Any]:
    """eae_jax LM params -> llama2.c Transformer state dict (torch tensors, dtypes and bits kept).

    A tied model gets ``output.weight`` as the same tensor as
    ``tok_embeddings.weight``, as llama2.c's own state dict has it.

    Example:
      >>> import jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import llama2c_state_dict, lm_config_from_model_args
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> sd = llama2c_state_dict(init_lm(jax.random.key(0), cfg), cfg)
      >>> sd["layers.0.feed_forward.w1.weight"].shape, sd["output.weight"] is sd["tok_embeddings.weight"]
      (torch.Size([16, 8]), True)
    """
    flat = lm_tensors_from_params(params, cfg, LLAMA2C_LM, tied_head=False)
    out = {k: numpy_to_torch(v) for k, v in flat.items()}
    if cfg.tie_embeddings:
        out[LLAMA2C_LM.head] = out[LLAMA2C_LM.embed]
    return out


def save_llama2c_pt(path: str, params: Mapping[str, Any], cfg: LMConfig,
                    model_args: Optional[Mapping[str, Any]] = None, **extra: Any) -> None:
    """Write ``{'model_args': ..., 'model': state_dict, **extra}`` with torch.save.

    Args:
      model_args: a base for the written model_args (e.g. ``meta['model_args']``
        of an import, so unset fields survive a round trip).
      **extra: further plain entries (``iter_num=...``).

    Example:
      >>> import os, tempfile, jax, torch
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, save_llama2c_pt
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
      >>> save_llama2c_pt(path, init_lm(jax.random.key(0), cfg), cfg, iter_num=10)
      >>> ckpt = torch.load(path, weights_only=True)
      >>> sorted(ckpt), ckpt["model_args"]["n_layers"]
      (['iter_num', 'model', 'model_args'], 1)
    """
    torch = require_torch()
    torch.save({"model_args": model_args_from_config(cfg, model_args), "model": llama2c_state_dict(params, cfg), **extra},
               path)


# --------------------------------------------------------------------------- .bin
def llama2c_rope_tables(head_dim: int, seq_len: int, theta: float = LLAMA2C_ROPE_THETA):
    """The cos/sin tables llama2.c's ``precompute_freqs_cis`` computes (float32 numpy ``(seq, head_dim/2)``).

    Example:
      >>> from interop.llama2c import llama2c_rope_tables
      >>> cos, sin = llama2c_rope_tables(head_dim=4, seq_len=3)
      >>> cos.shape, cos[0].tolist(), sin[0].tolist()
      ((3, 2), [1.0, 1.0], [0.0, 0.0])
    """
    torch = require_torch()
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_len), freqs).float()
    return torch.cos(angles).numpy(), torch.sin(angles).numpy()


def rope_tables_error(cos: np.ndarray, sin: np.ndarray, head_dim: int, theta: float = LLAMA2C_ROPE_THETA) -> float:
    """How far ``(seq, head_dim/2)`` cos/sin tables are from base-``theta`` RoPE tables,
    beyond the float32 rounding of their angles.

    llama2.c computes the angles in float32, so at position p an angle is off
    by a few of its ulps (about p * 2^-24 rad); that much (4 ulps) is allowed
    before the distance counts. Needs no torch: a float64 reference.

    Example:
      >>> from interop.llama2c import llama2c_rope_tables, rope_tables_error
      >>> cos, sin = llama2c_rope_tables(head_dim=8, seq_len=512)
      >>> rope_tables_error(cos, sin, 8) < 1e-7, rope_tables_error(cos, sin, 8, theta=10001.0) > 1e-4
      (True, True)
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2)[: head_dim // 2] / head_dim)
    angles = np.outer(np.arange(cos.shape[0]), inv_freq)
    slack = 4 * np.spacing(angles.astype(np.float32)).astype(np.float64)
    excess = max(float(np.max(np.abs(cos - np.cos(angles)) - slack)),
                 float(np.max(np.abs(sin - np.sin(angles)) - slack)))
    return max(excess, 0.0)


def _bin_layout(dim, hidden, layers, heads, kv, vocab, seq, shared, version):
    """(name, shape) in file order; per-layer tensors are stacked ``(L, ...)``."""
    hd = dim // heads
    kvd = kv * hd
    norms = [("attention_norm", (layers, dim)), ("ffn_norm", (layers, dim))]
    mats = [("wq", (layers, heads * hd, dim)), ("wk", (layers, kvd, dim)), ("wv", (layers, kvd, dim)),
            ("wo", (layers, dim, heads * hd))]
    ffn = [("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)), ("w3", (layers, hidden, dim))]
    if version == 0:
        order = [("tok_embeddings", (vocab, dim)), norms[0], *mats, norms[1], *ffn, ("norm", (dim,)),
                 ("freq_cis_real", (seq, hd // 2)), ("freq_cis_imag", (seq, hd // 2))]
    else:
        order = [*norms, ("norm", (dim,)), ("tok_embeddings", (vocab, dim)), *mats, *ffn]
    if not shared:
        order.append(("output", (vocab, dim)))
    return order


_BIN_TO_SD = {"attention_norm": "attention_norm.weight", "ffn_norm": "ffn_norm.weight", "wq": "attention.wq.weight",
              "wk": "attention.wk.weight", "wv": "attention.wv.weight", "wo": "attention.wo.weight",
              "w1": "feed_forward.w1.weight", "w2": "feed_forward.w2.weight", "w3": "feed_forward.w3.weight"}


def load_llama2c_bin(path: str, *, dtype: Any = None) -> ImportedModel:
    """Read a llama2.c ``.bin`` export (version 0 legacy or version 1) and import it.

    The RoPE tables a version-0 file carries are checked against base-10000
    interleaved tables (`rope_tables_error`, no torch needed) and kept in
    ``meta['rope_tables']`` so that `save_llama2c_bin` can write the file back
    byte for byte.

    Raises:
      CorruptCheckpointError: truncated file or trailing bytes.
      UnknownFormatError: not a llama2.c .bin; version 2 (Q8_0) is refused as
        unsupported.
      UnsupportedConfigError: RoPE tables that are not base-10000 tables.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, load_llama2c_bin, save_llama2c_bin
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> folder = tempfile.mkdtemp()
      >>> save_llama2c_bin(os.path.join(folder, "a.bin"), init_lm(jax.random.key(0), cfg), cfg)
      >>> model = load_llama2c_bin(os.path.join(folder, "a.bin"))
      >>> model.meta["format"], model.config.tie_embeddings
      ('llama2c_bin_v0', True)
      >>> save_llama2c_bin(os.path.join(folder, "b.bin"), model.params, model.config, rope_tables=model.meta["rope_tables"])
      >>> open(os.path.join(folder, "a.bin"), "rb").read() == open(os.path.join(folder, "b.bin"), "rb").read()
      True
    """
    fmt = detect_format(path)
    if fmt == "llama2c_bin_v2":
        raise UnknownFormatError(f"{path}: llama2.c version-2 (Q8_0 int8-quantized) .bin files are not supported; "
                                 "export version 0 or 1 (float32)")
    if fmt not in ("llama2c_bin_v0", "llama2c_bin_v1"):
        raise UnknownFormatError(f"{path}: not a llama2.c .bin file (detected {fmt})")
    with open(path, "rb") as f:
        data = f.read()
    if fmt == "llama2c_bin_v0":
        version = 0
        dim, hidden, layers, heads, kv, vocab, seq = struct.unpack("<7i", data[:28])
        shared = vocab > 0
        vocab = abs(vocab)
        offset = 28
    else:
        version = 1
        magic, _, dim, hidden, layers, heads, kv, vocab, seq = struct.unpack("<Ii7i", data[:36])
        shared = bool(data[36])
        offset = 256
    want = llama2c_bin_size(dim, hidden, layers, heads, kv, vocab, seq, shared, version)
    if len(data) != want:
        kind = "is truncated" if len(data) < want else "has trailing bytes"
        raise CorruptCheckpointError(f"{path}: header says {want} bytes, the file has {len(data)}: it {kind}")
    raw: Dict[str, np.ndarray] = {}
    for name, shape in _bin_layout(dim, hidden, layers, heads, kv, vocab, seq, shared, version):
        n = int(np.prod(shape))
        raw[name] = np.frombuffer(data, dtype="<f4", count=n, offset=offset).reshape(shape).astype(np.float32)
        offset += 4 * n
    tensors = {"tok_embeddings.weight": raw["tok_embeddings"], "norm.weight": raw["norm"]}
    for short, key in _BIN_TO_SD.items():
        for i in range(layers):
            tensors[f"layers.{i}.{key}"] = raw[short][i]
    if not shared:
        tensors["output.weight"] = raw["output"]
    args = {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv, "vocab_size": vocab,
            "hidden_dim": hidden, "max_seq_len": seq, "norm_eps": 1e-5}
    cfg = lm_config_from_model_args(args)
    cfg = LMConfig(cfg.vocab_size, cfg.depth, cfg.block, tie_embeddings=shared)
    meta = {"format": f"llama2c_bin_v{version}", "source": path, "sha256": file_sha256(path), "model_args": args}
    if version == 0:
        cos, sin = raw["freq_cis_real"], raw["freq_cis_imag"]
        err = rope_tables_error(cos, sin, dim // heads)
        if err > 1e-5:
            raise UnsupportedConfigError(
                f"{path}: its RoPE tables differ from base-10000 tables by up to {err:.3g}; only llama2.c's standard "
                "RoPE is supported")
        meta["rope_tables"] = (cos, sin)
        meta["rope_tables_max_abs_diff"] = err
    params = lm_params_from_tensors(tensors, cfg, LLAMA2C_LM, resolve_dtype(dtype), path)
    return ImportedModel(params, cfg, meta)


def save_llama2c_bin(path: str, params: Mapping[str, Any], cfg: LMConfig, *, version: int = 0,
                     rope_tables: Optional[tuple] = None) -> None:
    """Write a llama2.c ``.bin`` (version 0 legacy or version 1), float32 little-endian.

    Args:
      version: 0 (legacy: header of 7 int32, negative vocab = untied head,
        RoPE tables included) or 1 (256-byte ``ak42`` header).
      rope_tables: ``(cos, sin)`` to write into a version-0 file (pass
        ``meta['rope_tables']`` of an import for a byte-exact round trip);
        default: computed as llama2.c's torch code does.

    Raises:
      UnsupportedConfigError: a model llama2.c cannot express (see
        `model_args_from_config`), or an unknown version.
      ValueError: params do not match ``cfg``.

    Example:
      >>> import os, struct, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, save_llama2c_bin
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16, "max_seq_len": 16})
      >>> path = os.path.join(tempfile.mkdtemp(), "tiny.bin")
      >>> save_llama2c_bin(path, init_lm(jax.random.key(0), cfg), cfg)
      >>> struct.unpack("<7i", open(path, "rb").read(28))    # dim, hidden, layers, heads, kv heads, vocab, seq
      (8, 16, 1, 2, 2, 32, 16)
      >>> save_llama2c_bin(path, init_lm(jax.random.key(0), cfg), cfg, version=1)
      >>> open(path, "rb").read(4), os.path.getsize(path)   # magic 0x616b3432 ("ak42"); 256-byte header, no RoPE
      (b'24ka', 3936)
    """
    if version not in (0, 1):
        raise UnsupportedConfigError(f"llama2.c .bin version {version} is not supported for export (use 0 or 1)")
    model_args_from_config(cfg)  # validates the architecture
    b = cfg.block
    flat = lm_tensors_from_params(params, cfg, LLAMA2C_LM, tied_head=False)
    dim, hidden, layers, heads, kv, vocab, seq = (b.dim, b.ffn_hidden_dim, cfg.depth, b.num_heads, b.num_kv_heads,
                                                   cfg.vocab_size, b.max_seq_len)
    shared = cfg.tie_embeddings
    stacked = {short: np.stack([flat[f"layers.{i}.{key}"] for i in range(layers)]) for short, key in _BIN_TO_SD.items()}
    stacked["tok_embeddings"] = flat["tok_embeddings.weight"]
    stacked["norm"] = flat["norm.weight"]
    if not shared:
        stacked["output"] = flat["output.weight"]
    if version == 0:
        cos, sin = rope_tables if rope_tables is not None else llama2c_rope_tables(b.head_dim, seq)
        stacked["freq_cis_real"], stacked["freq_cis_imag"] = np.asarray(cos), np.asarray(sin)
        header = struct.pack("<7i", dim, hidden, layers, heads, kv, vocab if shared else -vocab, seq)
    else:
        header = struct.pack("<Ii7iB", LLAMA2C_MAGIC, 1, dim, hidden, layers, heads, kv, vocab, seq, int(shared))
        header += b"\0" * (256 - len(header))
    layout = _bin_layout(dim, hidden, layers, heads, kv, vocab, seq, shared, version)
    bad = [f"{name}: shape {stacked[name].shape}, the .bin layout needs {tuple(shape)}"
           for name, shape in layout if tuple(stacked[name].shape) != tuple(shape)]
    if bad:
        raise ValueError(f"{path}: nothing written: " + "; ".join(bad))
    with atomic_target(path) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for name, _ in layout:
            f.write(np.ascontiguousarray(stacked[name], dtype="<f4").tobytes())


def load_llama2c(path: str, *, dtype: Any = None) -> ImportedModel:
    """Import any llama2.c checkpoint file: ``.pt`` training checkpoint or ``.bin`` export.

    Raises:
      UnknownFormatError: the file is neither.

    Example:
      >>> import os, tempfile, jax
      >>> from eae_jax.models import init_lm
      >>> from interop.llama2c import lm_config_from_model_args, load_llama2c, save_llama2c_bin, save_llama2c_pt
      >>> cfg = lm_config_from_model_args({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "hidden_dim": 16})
      >>> params, folder = init_lm(jax.random.key(0), cfg), tempfile.mkdtemp()
      >>> save_llama2c_pt(os.path.join(folder, "ckpt.pt"), params, cfg)
      >>> save_llama2c_bin(os.path.join(folder, "model.bin"), params, cfg, version=1)
      >>> [load_llama2c(os.path.join(folder, name)).meta["format"] for name in ("ckpt.pt", "model.bin")]
      ['llama2c_pt', 'llama2c_bin_v1']
    """
    fmt = detect_format(path)
    if fmt == "torch_pickle":
        return load_llama2c_pt(path, dtype=dtype)
    if fmt.startswith("llama2c_bin"):
        return load_llama2c_bin(path, dtype=dtype)
    raise UnknownFormatError(f"{path}: not a llama2.c checkpoint (detected {fmt})")
