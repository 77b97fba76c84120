"""An exclusive lock on a run directory: one training run writes there at a time.

The lock is ``fcntl.flock`` on ``<out>/.lock``, which also holds the
holder's pid and host. The kernel drops a flock when its process dies, so a
lock left by a killed run never blocks: the next run takes it over and says
whose it was. Two runs in one process conflict too (each opens its own file
description).
"""

from __future__ import annotations

import fcntl
import os
import socket
from typing import Callable, Optional

LOCK_NAME = ".lock"


class RunLockedError(RuntimeError):
    """Another live run holds the run directory's lock (the message names it).

    Example:
      >>> import tempfile
      >>> from eae_jax.train.lock import RunLock, RunLockedError
      >>> out = tempfile.mkdtemp()
      >>> with RunLock(out, lambda m: None):
      ...     try:
      ...         with RunLock(out, lambda m: None):
      ...             pass
      ...     except RunLockedError:
      ...         print("refused")
      refused
    """


def _read_holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 256).decode("utf-8", "replace").strip()


class RunLock:
    """``with RunLock(out, log_fn): ...`` holds ``out``'s lock for the block.

    Raises (on enter):
      RunLockedError: a live process holds it; the message names its pid.
      OSError: the lock file cannot be created.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with RunLock(d):
    ...     try:
    ...         RunLock(d).acquire()
    ...     except RunLockedError as err:
    ...         print("refused")
    refused
    """

    def __init__(self, directory: str, log_fn: Optional[Callable[[str], None]] = None):
        self.path = os.path.join(directory, LOCK_NAME)
        self.log_fn = log_fn or (lambda msg: None)
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd) or "another process"
            os.close(fd)
            raise RunLockedError(
                f"run directory {os.path.dirname(self.path)} is in use by {holder} (lock {self.path}); "
                "wait for that run to finish, or pass another --out") from None
        except BaseException:
            os.close(fd)
            raise
        previous = _read_holder(fd)
        if previous:  # a run that ended without releasing: killed, or its machine went down
            self.log_fn(f"taking over the lock {self.path} of {previous}, which no longer holds it")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # a clean exit leaves no holder to take over from
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
