"""Training: config and presets, data, atomic checkpoints, the jitted loop."""

from eae_jax.train.errors import CheckpointError
from eae_jax.train.config import PRESETS, TrainConfig, parse_passes
from eae_jax.train.loop import TrainState, init_state, lr_schedule, make_optimizer, make_train_step, train

__all__ = [
    "CheckpointError", "PRESETS", "TrainConfig", "TrainState", "init_state", "lr_schedule", "make_optimizer",
    "make_train_step", "parse_passes", "train",
]
