"""Exceptions raised by `interop`.

Every error is a `ValueError` subclass, so ``except ValueError`` still works
for callers that do not care which check failed, while tests and tools can
tell a missing tensor from an unsafe pickle from an unknown file.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple


class InteropError(ValueError):
    """Base class of every error raised while reading or writing checkpoints.

    Example:
      >>> from interop.errors import CorruptCheckpointError, InteropError, UnknownFormatError
      >>> issubclass(CorruptCheckpointError, InteropError), issubclass(UnknownFormatError, InteropError)
      (True, True)
    """


class CheckpointMismatchError(InteropError):
    """The tensors of a checkpoint do not fit the model they are meant for.

    All problems are collected before raising, so one error names every
    missing key, every unexpected key, every shape mismatch and every dtype
    problem at once.

    Attributes:
      missing: names the model needs that the checkpoint lacks.
      unexpected: names in the checkpoint the model has no place for.
      shape_mismatches: ``(name, got_shape, expected_shape)`` triples.
      other: any further problems (dtype mixes, tied tables that differ ...).

    Example:
      >>> from interop.errors import CheckpointMismatchError
      >>> err = CheckpointMismatchError("model.safetensors", missing=["norm.weight"],
      ...                               shape_mismatches=[("embed", (4, 2), (5, 2))])
      >>> err.missing, err.shape_mismatches
      (['norm.weight'], [('embed', (4, 2), (5, 2))])
    """

    def __init__(
        self,
        where: str,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        shape_mismatches: Iterable[Tuple[str, tuple, tuple]] = (),
        other: Iterable[str] = (),
    ):
        self.where = where
        self.missing = sorted(missing, key=_natural_key)
        self.unexpected = sorted(unexpected, key=_natural_key)
        self.shape_mismatches = sorted(shape_mismatches, key=lambda t: _natural_key(t[0]))
        self.other = list(other)
        lines = [f"{where}: checkpoint does not match the model"]
        if self.missing:
            lines.append(f"  missing keys ({len(self.missing)}):")
            lines += [f"    {k}" for k in self.missing]
        if self.unexpected:
            lines.append(f"  unexpected keys ({len(self.unexpected)}):")
            lines += [f"    {k}" for k in self.unexpected]
        if self.shape_mismatches:
            lines.append(f"  shape mismatches ({len(self.shape_mismatches)}):")
            lines += [f"    {k}: checkpoint has {tuple(g)}, model expects {tuple(e)}" for k, g, e in self.shape_mismatches]
        if self.other:
            lines.append(f"  other problems ({len(self.other)}):")
            lines += [f"    {p}" for p in self.other]
        super().__init__("\n".join(lines))

    @property
    def empty(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatches or self.other)


class UnsafeCheckpointError(InteropError):
    """A pickle asked for something outside the weights-only allowlist.

    Raised instead of executing it: nothing from the file ran.

    Attributes:
      path: the file.
      global_name: the refused global (``module.name``) when torch reported it.

    Example:
      >>> from interop.errors import UnsafeCheckpointError
      >>> err = UnsafeCheckpointError("m.pt", "refused global", global_name="os.system")
      >>> err.path, err.global_name
      ('m.pt', 'os.system')
    """

    def __init__(self, path: str, detail: str, global_name: Optional[str] = None):
        self.path = path
        self.global_name = global_name
        what = f"the global {global_name!r}" if global_name else "an object outside the allowlist"
        super().__init__(
            f"{path}: refused to load: the pickle references {what}, which a weights-only load does not "
            f"allow (it could run arbitrary code). Nothing from the file was executed. Only load "
            f"checkpoints of plain tensors/dicts (or the allowlisted reference modules). Detail: {detail}"
        )


class CorruptCheckpointError(InteropError):
    """The file is truncated or otherwise damaged.

    Example:
      >>> import os, tempfile
      >>> import interop
      >>> from interop.errors import CorruptCheckpointError
      >>> path = os.path.join(tempfile.mkdtemp(), "cut.bin")
      >>> _ = open(path, "wb").write((0x616B3432).to_bytes(4, "little") + (1).to_bytes(4, "little") + bytes(20))
      >>> try:
      ...     interop.load_llama2c(path)
      ... except CorruptCheckpointError:
      ...     print("corrupt")
      corrupt
    """


class UnknownFormatError(InteropError):
    """The file (or object) is not any of the supported checkpoint formats.

    Example:
      >>> import interop, os, tempfile
      >>> from interop.errors import UnknownFormatError
      >>> folder = tempfile.mkdtemp()
      >>> with open(os.path.join(folder, "notes.txt"), "w") as f:
      ...     _ = f.write("not a checkpoint")
      >>> try:
      ...     interop.load_checkpoint(os.path.join(folder, "notes.txt"))
      ... except UnknownFormatError as err:
      ...     print(type(err).__name__)
      UnknownFormatError
    """


class Float64CheckpointError(InteropError, TypeError):
    """float64 weights while JAX runs without x64: importing them would round
    to float32 silently. A TypeError too (it is about the dtype), and an
    `InteropError` like every other checkpoint problem.

    Example:
      >>> from interop.errors import Float64CheckpointError, InteropError
      >>> issubclass(Float64CheckpointError, TypeError), issubclass(Float64CheckpointError, InteropError)
      (True, True)
    """


class UnsupportedConfigError(InteropError):
    """The checkpoint's architecture has a feature the JAX port does not implement
    (biases, rope scaling, dropout, another activation ...).

    Example:
      >>> from interop.hf_llama import lm_config_from_hf
      >>> from interop.errors import UnsupportedConfigError
      >>> try:
      ...     lm_config_from_hf({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 16,
      ...                        "intermediate_size": 16, "hidden_act": "gelu"})
      ... except UnsupportedConfigError:
      ...     print("unsupported")
      unsupported
    """


def _natural_key(name: str) -> Sequence:
    """Sort ``layers.10`` after ``layers.9``."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
