"""Files and directories of the proxy's state, private to the user it runs as.

What the proxy keeps on disk names users, keys' names, teams and what they spent (the ledger's
rows and its SQLite file, the budget's settlement spool, the shipper's status) and, with capture
on, whole prompts and answers: not for every local account to read. Every file the proxy creates
there is 0600 and every directory it creates 0700 (created with that mode, which a umask can
only narrow, and set again where the proxy has just made the file or directory). What exists
already keeps its mode: a directory made by the operator (a volume, a group-readable spool) is
the operator's choice.

SQLite creates a database's `-wal` and `-shm` files with the database file's own permissions,
so creating that file 0600 before SQLite opens it (`create_private`) makes all three private.
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> Path:
    """Make `path`, and every missing directory above it, 0700; one that exists is left as it
    is. Returns `path`."""
    missing: list[Path] = []
    at = path
    while not at.is_dir():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # another process made it just now: theirs to set
        os.chmod(d, DIR_MODE)  # mkdir's mode went through the umask
    return path


def private_opener(path: str | Path, flags: int) -> int:
    """`open(..., opener=private_opener)`, or `os.open`'s arguments: a file it creates is 0600
    (the umask can only take bits away; an existing file keeps its mode), close-on-exec as every
    descriptor of the proxy's."""
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)


def create_private(path: Path) -> Path:
    """Create `path` empty and 0600, with its directory (`private_dir`), unless it exists: so a
    program that then creates it (SQLite) finds it private. Returns `path`."""
    private_dir(path.parent)
    try:
        fd = private_opener(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return path
    try:
        os.fchmod(fd, FILE_MODE)  # ours, just made: exactly 0600, whatever the umask left
    finally:
        os.close(fd)
    return path
