"""Writing files whole or not at all."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write ``path`` whole or not at all: a temporary file in the same folder, then a
    rename (a reader, or a run killed meanwhile, sees the old file or the new one).

    The file gets the mode any new file of the user gets (0666 less the umask), as
    ``open`` would give it: ``tempfile.mkstemp`` makes 0600 files, which other users of
    a shared run store could not read."""
    path = Path(path)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:  # another writer's temporary file: draw another name
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
