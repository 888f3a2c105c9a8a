"""Files written whole and checked: a file's SHA-256, and writing under a temporary name renamed when complete.
Imports nothing heavy (the recipes use it before torch is loaded)."""

from __future__ import annotations

import hashlib
import os


def sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomically(path: str | os.PathLike, write) -> None:
    """``write(temporary_path)``, then rename onto ``path``: a reader finds the old file or the new one, never half."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

