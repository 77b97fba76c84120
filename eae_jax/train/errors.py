"""The errors checkpoints raise (shared by the Orbax store and the legacy ``.npz`` reader)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit the expected state.

    >>> isinstance(CheckpointError("x"), ValueError)
    True
    """


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint cannot be read at all (not a checkpoint, damaged, truncated).

    >>> issubclass(UnreadableCheckpointError, CheckpointError)
    True
    """
