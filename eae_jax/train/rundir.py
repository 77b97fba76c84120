"""A training run's directory: the up-front write check, the JSON-lines log,
and write errors that name the step and the file."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

from eae_jax.fileio import new_file_mode


class RunWriteError(OSError):
    """A write of the run failed (disk full, permissions changed ...): the
    message names the step and the file; the checkpoints written so far stay.

    Example:
      >>> from eae_jax.train.rundir import RunWriteError
      >>> issubclass(RunWriteError, OSError) or issubclass(RunWriteError, RuntimeError)
      True
    """


@contextlib.contextmanager
def naming_writes(step: int, path: str):
    """Re-raise an OSError of the block as `RunWriteError` naming ``step`` and ``path``.

    >>> try:
    ...     with naming_writes(7, "/no/such/dir/log.jsonl"):
    ...         open("/no/such/dir/log.jsonl", "a")
    ... except RunWriteError as err:
    ...     print(err)
    step 7: cannot write /no/such/dir/log.jsonl: No such file or directory
    """
    try:
        yield
    except RunWriteError:
        raise
    except OSError as err:
        failure = RunWriteError(f"step {step}: cannot write {path}: {err.strerror or err}")
        failure.errno = err.errno
        raise failure from err


def prepare_out(out: str) -> str:
    """Create ``out/checkpoints`` and check that the run can write everything it
    writes (files in ``out`` itself: the log, its rewrite, the lock; files in
    ``out/checkpoints``); returns the checkpoint directory.

    Raises:
      ValueError: ``out`` (or ``out/checkpoints``, ``out/log.jsonl``) is not what it should be.
      PermissionError: it cannot be written (a read-only ``out`` whose parent is writable included).

    Example:
      >>> import os, tempfile
      >>> from eae_jax.train.rundir import prepare_out
      >>> out = os.path.join(tempfile.mkdtemp(), "run")
      >>> os.path.relpath(prepare_out(out), out)
      'checkpoints'
    """
    ckpt_dir = os.path.join(out, "checkpoints")
    for path, kind in ((out, "directory"), (ckpt_dir, "directory")):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"output {kind} {path} exists and is not a directory")
    log = os.path.join(out, "log.jsonl")
    if os.path.isdir(log):
        raise ValueError(f"log file {log} is a directory")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        for directory in (out, ckpt_dir):  # the log is rewritten through out/log.jsonl.tmp
            fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=directory)
            os.close(fd)
            os.unlink(probe)
        with open(log, "a"):
            pass
    except OSError as err:
        raise PermissionError(f"cannot write to output directory {out}: {err}") from err
    return ckpt_dir


class JsonlLog:
    """Append-only JSON-lines log (one object per line, flushed each write).

    Example:
      >>> import os, tempfile
      >>> from eae_jax.train.rundir import JsonlLog
      >>> log = JsonlLog(os.path.join(tempfile.mkdtemp(), "log.jsonl"))
      >>> log.write({"step": 1, "loss": 2.5}); log.write({"step": 2, "loss": 2.0})
      >>> log.truncate_after(1)
      >>> log.records()
      [{'step': 1, 'loss': 2.5}]
    """

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list:
        """The complete, parseable records (dicts) in file order ([] when there is no file)."""
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path) as f:
            for line in f:
                if not line.endswith("\n"):
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out.append(record)
        return out

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` and a torn last line (atomically; a no-op when none)."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = f.readlines()
        keep = []
        for line in lines:
            if not line.endswith("\n"):
                continue  # torn by a kill mid-write: the next write would glue onto it
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
                continue
            keep.append(line)
        if len(keep) == len(lines):
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            os.chmod(tmp, new_file_mode(self.path))
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
