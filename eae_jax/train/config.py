"""Training configuration: the TrainConfig (presets and shapes: `eae_jax.train.shapes`), pass specs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

from eae_jax.blocks.transformer import BlockConfig
from eae_jax.dtypes import DTypePolicy
from eae_jax.fp8 import ACTIVATION_SCALINGS, FALLBACKS, GRAD_SCALINGS, WEIGHT_SCALINGS
from eae_jax.models.llama import LMConfig
from eae_jax.train.shapes import PRESETS, resolve_shape

def parse_passes(spec: str):
    """Build a pass chain from a spec such as ``"int8,clip=1.0"`` (None when empty).

    The grammar and the table of passes are `eae_jax.passes.spec`: every
    built-in pass by its factory name or short alias (``clip``, ``int8``,
    ``fp16``, ``bf16``, ``fp8``, ``decay``, ``noise``, ``stats``, ``topk``,
    ``guard``, ``synthetic``, ``capture`` ...), with all its hyper-parameters.

    Raises:
      ValueError: unknown name (listing the valid names), bad value or syntax.

    Example:
      >>> from eae_jax.train.config import parse_passes
      >>> parse_passes("int8,clip=1.0").name, parse_passes("") is None
      ('chain(int8_fake_quant, clip_by_norm(1))', True)
    """
    from eae_jax.passes.spec import parse_passes as parse

    return parse(spec)


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs. See ``eae-jax train --help``.

    ``batch`` is the global batch per optimizer step, split into
    ``microbatches`` equal parts whose gradients are accumulated in
    ``grad_accum_dtype``. The model is the preset with the shape fields over
    it (`eae_jax.train.shapes`); ``text=[]`` trains on the standard library,
    ``text=None`` and ``data=None`` on the synthetic task.

    Example:
      >>> from eae_jax.train import TrainConfig
      >>> cfg = TrainConfig(preset="tiny", dim=32, heads=2, seq_len=16)
      >>> cfg.model().dim, cfg.model().block.num_heads, cfg.batch, cfg.text is None
      (32, 2, 16, True)
    """

    preset: str = "tiny"
    steps: int = 200
    batch: Optional[int] = None
    seq_len: Optional[int] = None
    microbatches: int = 1
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: Optional[float] = 1.0
    dtype: str = "fp32"
    boundary_dtype: Optional[str] = None
    policy: Optional[str] = None
    offload: bool = False
    passes: str = ""
    grad_accum_dtype: str = "fp32"
    seed: int = 0
    data: Optional[str] = None
    out: str = "runs/eae"
    checkpoint_every: int = 100
    keep: int = 3
    resume: bool = True
    log_every: int = 10
    devices: Optional[int] = None
    mesh: Optional[str] = None
    coordinator: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    fp8_scaling: str = "delayed"
    # The fastest guarded fp8 training on the H200 (README, "fp8 seams").
    fp8_fallback: str = "step"
    fp8_grad_scaling: str = "delayed"
    fp8_weight_scaling: str = "delayed"
    # Model shape over the preset (None: the preset's; the vocabulary of a text run: its tokenizer's).
    vocab_size: Optional[int] = None
    dim: Optional[int] = None
    depth: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    ffn: Optional[int] = None
    norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    rope_style: Optional[str] = None
    tie_embeddings: bool = False
    # Text: None trains on `data` (or the synthetic task); [] the standard library; else files and folders.
    text: Optional[list] = None
    tokenizer: Optional[str] = None
    val_fraction: float = 0.05
    val_data: Optional[str] = None
    val_every: int = 50
    val_batches: int = 4
    init: Optional[str] = None
    # Reporting: how a run shows itself (a resumed run may change these).
    quiet: bool = False
    tensorboard: Optional[bool] = None
    plot: bool = True
    peak_tflops: Optional[float] = None
    profile: Optional[str] = None
    # The fastest step within this much device memory ('6GiB', or '0.5' of plain autodiff's activations).
    memory_budget: Optional[str] = None

    def __post_init__(self):
        self._check_types()
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; valid: {', '.join(PRESETS)}")
        preset = PRESETS[self.preset]
        # None means the preset's value; 0 or a negative number is an error, not "the default".
        self.batch = preset["batch"] if self.batch is None else self.batch
        self.seq_len = preset["seq_len"] if self.seq_len is None else self.seq_len
        for name in ("steps", "batch", "seq_len", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"devices must be >= 1 (or unset: all devices), got {self.devices}")
        if self.mesh is not None:
            from eae_jax.parallel.mesh import format_mesh, parse_mesh

            if self.devices is not None:
                raise ValueError(f"devices={self.devices} and mesh={self.mesh!r} both given: devices=N is the mesh "
                                 "data=N; give one of them")
            self.mesh = format_mesh(parse_mesh(self.mesh))  # validated, in its canonical spelling
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and (self.process_id < 0 or (self.num_processes is not None and
                                                                     self.process_id >= self.num_processes)):
            raise ValueError(f"process_id must lie in [0, num_processes), got {self.process_id}")
        for name in ("warmup", "keep"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and (not math.isfinite(self.grad_clip) or self.grad_clip < 0):
            raise ValueError(f"grad_clip must be a finite number > 0 (0 or unset: no clipping), got {self.grad_clip}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.batch % self.microbatches:
            raise ValueError(f"batch {self.batch} must split into microbatches={self.microbatches} equal parts")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed}")
        if not self.out or "\0" in self.out:
            raise ValueError(f"out must name a run directory, got {self.out!r}")
        if self.data is not None and (not self.data or "\0" in self.data):
            raise ValueError(f"data must name a token file (or be unset: the synthetic task), got {self.data!r}")
        if self.data:
            # Stored absolute: a resume from another directory must not read another file of the same name.
            self.data = os.path.abspath(self.data)
        self._check_text_and_reporting()
        self.shape = resolve_shape(self.preset, **{k: getattr(self, k) for k in (
            "vocab_size", "depth", "dim", "heads", "kv_heads", "ffn", "norm_eps", "rope_theta", "rope_style")})
        self.policy_obj = DTypePolicy.from_name(self.dtype)  # validates the name
        from eae_jax.dtypes import parse_compute_dtype

        try:  # validates the name before a model is built
            parse_compute_dtype(self.grad_accum_dtype)
        except ValueError as err:
            raise ValueError(f"grad_accum_dtype: {err}") from err
        if self.boundary_dtype is not None:
            try:
                parse_compute_dtype(self.boundary_dtype)
            except ValueError as err:
                raise ValueError(f"boundary_dtype: {err}") from err
        if self.policy is not None:
            from eae_jax.reconstruct import resolve_policy

            resolve_policy(self.policy)  # "unknown policy ..."
        parse_passes(self.passes)  # a bad --passes fails here, before a model is built
        if self.memory_budget is not None:
            from eae_jax.train.budget import parse_memory_budget

            parse_memory_budget(self.memory_budget)
            given = [f"--{n.replace('_', '-')}" for n, v in (("policy", self.policy), ("offload", self.offload),
                                                              ("boundary_dtype", self.boundary_dtype)) if v]
            if given:
                raise ValueError(f"give --memory-budget or {', '.join(given)}, not both (the budget plans what "
                                 "each block keeps and where)")
        for field, valid in (("fp8_scaling", ACTIVATION_SCALINGS), ("fp8_fallback", FALLBACKS),
                             ("fp8_grad_scaling", GRAD_SCALINGS), ("fp8_weight_scaling", WEIGHT_SCALINGS)):
            value = getattr(self, field)
            if value not in valid:
                raise ValueError(f"unknown {field} {value!r}; valid: {', '.join(valid)}")
        if self.fp8:
            from eae_jax.fp8 import policy_seams

            policy_seams(self.policy_obj)  # raises for formats the seams cannot compute in

    def _check_text_and_reporting(self) -> None:
        """The text, validation, --init and reporting fields (before anything is read or built)."""
        if self.text is not None:
            if self.data:
                raise ValueError("give --text or --data, not both")
            bad = [p for p in self.text if not isinstance(p, str) or not p or "\0" in p]
            if bad:
                raise ValueError(f"text must list files and folders, got {bad[0]!r}")
            self.text = [os.path.abspath(p) for p in self.text]  # stored absolute, as data
        if self.tokenizer is not None:
            if self.text is None:
                raise ValueError("--tokenizer applies to --text runs (token files are already tokenized)")
            if not self.tokenizer or "\0" in self.tokenizer:
                raise ValueError(f"tokenizer must be bytes, bpe:<vocab size> or a tokenizer file, got {self.tokenizer!r}")
            if self.tokenizer.startswith("bpe:") and not os.path.exists(self.tokenizer):
                size = self.tokenizer[4:]
                if not size.isdigit() or not 257 <= int(size) < 2 ** 31:
                    raise ValueError(f"tokenizer {self.tokenizer!r}: expected bpe:<vocab size >= 257>, e.g. bpe:4096")
        if not 0 < self.val_fraction <= 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5], got {self.val_fraction}")
        for name in ("val_data", "init"):
            value = getattr(self, name)
            if value is not None and (not value or "\0" in value):
                raise ValueError(f"{name} must name a file or directory, got {value!r}")
            if value:
                setattr(self, name, os.path.abspath(value))
        if self.val_data and self.text is not None:
            raise ValueError("--val-data applies to --data runs (a text run holds out part of its text)")
        if self.val_every < 0:
            raise ValueError(f"val_every must be >= 0 (0: no validation), got {self.val_every}")
        if self.val_batches < 1:
            raise ValueError(f"val_batches must be >= 1, got {self.val_batches}")
        if self.peak_tflops is not None and (not math.isfinite(self.peak_tflops) or self.peak_tflops <= 0):
            raise ValueError(f"peak_tflops must be a finite number > 0, got {self.peak_tflops}")
        if self.profile is not None:
            from eae_jax.train.profile import parse_profile_steps

            parse_profile_steps(self.profile)

    def _check_types(self) -> None:
        """TypeError naming the field whose value is not of its declared type (bools are not ints)."""
        for field in dataclasses.fields(self):
            problem = _type_problem(field, getattr(self, field.name))
            if problem:
                raise TypeError(problem)
        if isinstance(self.text, tuple):
            self.text = list(self.text)

    @property
    def fp8(self) -> bool:
        """Whether this run binds fp8 seams (``--dtype fp8_e4m3`` / ``fp8_e5m2``)."""
        return self.policy_obj.fp8_format is not None

    def model(self) -> LMConfig:
        """The LMConfig of this run: the preset, the shape fields over it, the dtype policy."""
        s = self.shape
        compute = self.policy_obj.compute_dtype
        block = BlockConfig(dim=s["dim"], num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"],
                            ffn_hidden_dim=s["ffn_hidden_dim"], norm_eps=s["norm_eps"], rope_theta=s["rope_theta"],
                            rope_style=s["rope_style"], max_seq_len=max(self.seq_len, 16),
                            compute_dtype=None if compute == self.policy_obj.param_dtype else compute)
        return LMConfig(vocab_size=s["vocab_size"], depth=s["depth"], block=block,
                        tie_embeddings=self.tie_embeddings)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("policy_obj", None)
        d.pop("shape", None)
        return d


_KINDS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
          "list": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)}


def _type_problem(field: dataclasses.Field, value) -> Optional[str]:
    """Why ``value`` does not fit the field's declared type (None when it does)."""
    optional = field.type.startswith("Optional[")
    kind = field.type[len("Optional["):-1] if optional else field.type
    if (value is None and optional) or _KINDS[kind](value):
        return None
    return f"{field.name} must be {'None or ' if optional else ''}{kind}{' of str' if kind == 'list' else ''}, got {value!r}"


def read_config_file(path: str) -> dict:
    """TrainConfig fields from a JSON (``.json``) or TOML (``.toml``) file: ``{"dim": 128, ...}``.

    Keys are field names (``seq_len`` or ``seq-len``); a TOML file may also
    hold them in a ``[train]`` table. Value types are checked here, the rest
    when the TrainConfig is made; paths in them are relative to the working
    directory, as on the command line.

    Raises:
      FileNotFoundError: no such file.
      ValueError: unreadable JSON/TOML, not a table of settings, unknown keys
        (all named, with the valid ones), a value of the wrong type.

    Example:
      >>> import json, os, tempfile
      >>> from eae_jax.train.config import TrainConfig, read_config_file
      >>> path = os.path.join(tempfile.mkdtemp(), "run.json")
      >>> with open(path, "w") as f:
      ...     json.dump({"preset": "tiny", "dim": 32, "seq-len": 32}, f)
      >>> values = read_config_file(path)
      >>> values, TrainConfig(**values).model().dim
      ({'preset': 'tiny', 'dim': 32, 'seq_len': 32}, 32)
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    if path.lower().endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError as err:
                raise ValueError(f"config file {path}: TOML needs Python 3.11 (or pip install tomli); "
                                 "a .json file works everywhere") from err
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"config file {path} is not valid TOML: {err}") from err
        if isinstance(data.get("train"), dict) and len(data) == 1:
            data = data["train"]
    elif path.lower().endswith(".json"):
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"config file {path} is not valid JSON: {err}") from err
    else:
        raise ValueError(f"config file {path}: expected a .json or .toml file")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table of settings, got a {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(k for k in values if k not in fields)
    if unknown:
        raise ValueError(f"config file {path}: unknown settings {unknown}; valid: {', '.join(sorted(fields))}")
    for field in dataclasses.fields(TrainConfig):
        problem = _type_problem(field, values[field.name]) if field.name in values else None
        if problem:
            raise ValueError(f"config file {path}: {problem}")
    return values
