"""Output paths: checked before a run, so that a slow run never ends in a file it cannot write.

``check_file(path, option)`` and ``check_dir(path, option)`` raise a one-line
:class:`~trainmem.errors.TrainmemError` naming the option, the path and the fix when the file or
directory cannot be written; ``not_written`` turns an ``OSError`` met while writing anyway (a disk
that filled up, a folder removed during the run) into the same kind of line. :class:`NotWritten` is
that error with the result it could not save attached (``report``), so that a caller can still
show the measurement. Write permission is read with ``os.access`` (POSIX ``access(2)``: the real
user's permissions; root passes it on any folder).
"""
from __future__ import annotations

import os
from typing import Any

from .errors import TrainmemError


class NotWritten(TrainmemError):
    """An output file that could not be written after the run; ``report`` is the run's result."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


def not_written(path: str, option: str, e: OSError) -> str:
    """The one line for an ``OSError`` ``e`` met while writing ``path`` (given as ``option``)."""
    why = e.strerror or (str(e).splitlines()[0] if str(e).strip() else type(e).__name__)
    return f"{option} {path}: cannot write it ({why})"


def _check_parent(path: str, option: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise TrainmemError(f"{option} {path}: directory {parent} does not exist (create it or choose another path)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TrainmemError(f"{option} {path}: directory {parent} is not writable (choose another path)")


def check_file(path: str, option: str) -> str:
    """Raise unless a file can be written at ``path``: its folder exists and is writable, and it is
    not a directory nor a read-only file. Returns ``path``."""
    if not str(path).strip():
        raise TrainmemError(f"{option}: empty path")
    if os.path.isdir(path):
        raise TrainmemError(f"{option} {path}: is a directory (give a file name)")
    _check_parent(path, option)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise TrainmemError(f"{option} {path}: the file exists and is read-only (choose another path)")
    return path


def check_dir(path: str, option: str) -> str:
    """Raise unless files can be written into the directory ``path``; a missing directory is
    created (with its missing parents). Returns ``path``."""
    if not str(path).strip():
        raise TrainmemError(f"{option}: empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise TrainmemError(f"{option} {path}: exists and is not a directory")
    if not os.path.isdir(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise TrainmemError(f"{option} {path}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise TrainmemError(f"{option} {path}: directory is not writable (choose another directory)")
    return path
