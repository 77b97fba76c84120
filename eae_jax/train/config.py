"""Training configuration: model presets, pass specs, and the TrainConfig."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from eae_jax.blocks.transformer import BlockConfig
from eae_jax.dtypes import DTypePolicy
from eae_jax.fp8 import ACTIVATION_SCALINGS, FALLBACKS, GRAD_SCALINGS, WEIGHT_SCALINGS
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
    """Build a pass chain from a comma list such as ``"int8,clip=1.0"``.

    Names: ``clip=<max_norm>``, ``int8``, ``fp16``, ``bf16``, ``fp8`` /
    ``fp8=e5m2``, ``decay=<strength>``, ``noise=<std>``, ``stats``,
    ``topk=<ratio>``, ``guard`` / ``guard=<zero|skip|raise>``. Empty: no passes.

    Raises:
      ValueError: unknown name or bad value (listing the valid names).
    """
    from eae_jax import passes as P

    builders = {
        "clip": lambda v: P.clip_by_norm(float(v if v is not None else 1.0)),
        "int8": lambda v: P.int8_fake_quant(),
        "fp16": lambda v: P.cast_roundtrip("fp16"),
        "bf16": lambda v: P.cast_roundtrip("bf16"),
        "fp8": lambda v: P.fp8_quant(format=v or "e4m3"),
        "decay": lambda v: P.decay(float(v)),
        "noise": lambda v: P.gaussian_noise(float(v)),
        "stats": lambda v: P.statistics(),
        "topk": lambda v: P.topk_compress(float(v)),
        "guard": lambda v: P.nonfinite_guard(v or "zero"),
    }
    chain = []
    for item in [s.strip() for s in (spec or "").split(",") if s.strip()]:
        name, _, value = item.partition("=")
        if name not in builders:
            raise ValueError(f"unknown pass {name!r} in {spec!r}; valid: {', '.join(sorted(builders))}")
        try:
            chain.append(builders[name](value or None))
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad value for pass {name!r} in {spec!r}: {err}") from err
    return P.chain(*chain) if chain else None


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
    fp8_scaling: str = "delayed"
    # The fastest guarded fp8 training on the H200 (README, "fp8 seams").
    fp8_fallback: str = "step"
    fp8_grad_scaling: str = "delayed"
    fp8_weight_scaling: str = "delayed"

    def __post_init__(self):
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
        if self.data:
            # Stored absolute: a resume from another directory must not read another file of the same name.
            self.data = os.path.abspath(self.data)
        self.policy_obj = DTypePolicy.from_name(self.dtype)  # validates the name
        from eae_jax.dtypes import parse_compute_dtype

        try:  # validates the name before a model is built
            parse_compute_dtype(self.grad_accum_dtype)
        except ValueError as err:
            raise ValueError(f"grad_accum_dtype: {err}") from err
        for field, valid in (("fp8_scaling", ACTIVATION_SCALINGS), ("fp8_fallback", FALLBACKS),
                             ("fp8_grad_scaling", GRAD_SCALINGS), ("fp8_weight_scaling", WEIGHT_SCALINGS)):
            value = getattr(self, field)
            if value not in valid:
                raise ValueError(f"unknown {field} {value!r}; valid: {', '.join(valid)}")
        if self.fp8:
            from eae_jax.fp8 import policy_seams

            policy_seams(self.policy_obj)  # raises for formats the seams cannot compute in

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
