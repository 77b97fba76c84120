"""File-writing helpers shared by training checkpoints and interop exports."""

from __future__ import annotations

import os
import stat
from typing import Optional


def new_file_mode(replacing: Optional[str] = None) -> int:
    """Permission bits for a file written through a temporary: those of the
    file it replaces, else what ``open()`` would give under the current umask.
    (``tempfile.mkstemp`` creates 0600, which left checkpoints and exports
    unreadable to the other users and services a plain write lets in.)"""
    if replacing is not None:
        try:
            return stat.S_IMODE(os.stat(replacing).st_mode)
        except OSError:
            pass
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
