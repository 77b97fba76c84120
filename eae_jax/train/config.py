"""Training configuration: model presets, pass specs, and the TrainConfig."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from eae_jax.blocks.transformer import BlockConfig
from eae_jax.dtypes import DTypePolicy
from eae_jax.fp8.block import FALLBACKS
from eae_jax.fp8.quant import WEIGHT_SCALINGS
from eae_jax.fp8.seams import GRAD_SCALINGS, SCALINGS
from eae_jax.models.llama import LMConfig

#: Model and batch presets. ``tiny`` trains in seconds on a laptop CPU.
PRESETS = {
    "tiny": dict(vocab_size=256, depth=4, dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_dim=176,
                 seq_len=64, batch=16),
    "small": dict(vocab_size=4096, depth=8, dim=256, num_heads=8, num_kv_heads=2, ffn_hidden_dim=768,
                  seq_len=256, batch=16),
    "medium": dict(vocab_size=32000, depth=16, dim=2048, num_heads=16, num_kv_heads=4, ffn_hidden_dim=5632,
                   seq_len=2048, batch=4),
    "7b-like": dict(vocab_size=32000, depth=8, dim=4096, num_heads=32, num_kv_heads=8, ffn_hidden_dim=11008,
                    seq_len=4096, batch=2),
}


def parse_passes(spec: str):
    """Build a pass chain from a spec such as ``"int8,clip=1.0"`` (None when empty).

    The grammar and the table of passes are `eae_jax.passes.spec`: every
    built-in pass by its factory name or short alias (``clip``, ``int8``,
    ``fp16``, ``bf16``, ``fp8``, ``decay``, ``noise``, ``stats``, ``topk``,
    ``guard``, ``synthetic``, ``capture`` ...), with all its hyper-parameters.

    Raises:
      ValueError: unknown name (listing the valid names), bad value or syntax.
    """
    from eae_jax.passes.spec import parse_passes as parse

    return parse(spec)


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs. See ``eae-jax train --help``.

    ``batch`` is the global batch per optimizer step, split into
    ``microbatches`` equal parts whose gradients are accumulated in
    ``grad_accum_dtype``.
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
        for field, valid in (("fp8_scaling", SCALINGS), ("fp8_fallback", FALLBACKS),
                             ("fp8_grad_scaling", GRAD_SCALINGS), ("fp8_weight_scaling", WEIGHT_SCALINGS)):
            value = getattr(self, field)
            if value not in valid:
                raise ValueError(f"unknown {field} {value!r}; valid: {', '.join(valid)}")
        if self.fp8:
            from eae_jax.fp8 import policy_seams

            policy_seams(self.policy_obj)  # raises for formats the seams cannot compute in

    def _check_types(self) -> None:
        """TypeError naming the field whose value is not of its declared type (bools are not ints)."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            optional = field.type.startswith("Optional[")
            kind = field.type[len("Optional["):-1] if optional else field.type
            if value is None and optional:
                continue
            ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str)}[kind](value)
            if not ok:
                raise TypeError(f"{field.name} must be {'None or ' if optional else ''}{kind}, got {value!r}")

    @property
    def fp8(self) -> bool:
        """Whether this run binds fp8 seams (``--dtype fp8_e4m3`` / ``fp8_e5m2``)."""
        return self.policy_obj.fp8_format is not None

    def model(self) -> LMConfig:
        """The LMConfig of this run's preset and dtype policy."""
        p = PRESETS[self.preset]
        compute = self.policy_obj.compute_dtype
        block = BlockConfig(dim=p["dim"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                            ffn_hidden_dim=p["ffn_hidden_dim"], max_seq_len=max(self.seq_len, 16),
                            compute_dtype=None if compute == self.policy_obj.param_dtype else compute)
        return LMConfig(vocab_size=p["vocab_size"], depth=p["depth"], block=block)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("policy_obj", None)
        return d
