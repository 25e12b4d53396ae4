"""Where the farm writes for a user (exports, libraries, plots, logs): each path checked before
anything is submitted or written, and each file written whole or not at all.

A path is checked by doing what writing it needs, not by reading permission bits: a file is made
in the folder and removed (root passes every permission check, yet nothing can be made in
/proc; a read-only mount says so only when written to).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from farm.core.errors import FarmError


def writable_file(path: str | Path) -> Path:
    """`path` as a Path if a file can be written there: its folder exists and takes a new file,
    and it is not a folder. FarmError (one line, saying why) otherwise; nothing is left behind."""
    target = Path(path)
    if target.is_dir():
        raise FarmError(f"cannot write {target}: it is a folder; give a file name")
    if not target.parent.is_dir():  # Path("x").parent is Path("."), which exists
        raise FarmError(f"cannot write {target}: folder {target.parent} does not exist")
    _try_a_file_in(target.parent, target)
    return target


def writable_folder(path: str | Path, to_write: str | Path | None = None) -> Path:
    """`path` as a Path once it is a folder that takes new files: made (with its parents) if it is
    missing. FarmError (one line, naming `to_write`, what is to be written there, if given) otherwise."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FarmError(f"cannot make folder {folder}: {e.strerror or e}") from None
    _try_a_file_in(folder, Path(to_write) if to_write is not None else folder)
    return folder


def _try_a_file_in(folder: Path, for_path: Path) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".farm-write-check.", dir=folder)
    except OSError as e:
        raise FarmError(f"cannot write {for_path}: {e.strerror or e} in folder {folder}") from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def replacing(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside `path` (ending in `suffix`, for writers that go by the extension) to
    write the whole file to; moved onto `path` when the block ends, removed if it raises. A failed
    write never leaves a partial file, nor a changed one where `path` existed."""
    target = writable_file(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
