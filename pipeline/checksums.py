"""File checksums every layer shares: sha256 of a file, of a directory's files, and a stat cache.

Artifacts, checkpoints, bundles, the tiny kit and model weights are all checked by sha256. Hashing a
16 GB local checkpoint takes about a minute, too slow to repeat on every ``drafter plan``, so
:class:`StatCache` remembers each file's digest under its (path, size, mtime) and hashes again only
when one of those changes (retraining in place, copying over, ``touch``). A file rewritten with the same
size and its old mtime restored would be missed; nothing the pipeline or a training run does keeps
mtimes, so this is the trade every build tool with a stat cache makes.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import socket
import tempfile
from pathlib import Path

CHUNK = 1 << 20


def temp_sibling(path: str | Path) -> Path:
    """Where to write ``path`` before renaming it into place: a hidden sibling named for this host, process and a
    random token. Ranks on two nodes may write the same file at once over a shared filesystem (the EAGLE-3 feature
    cache), and in containers their pids can be equal: a name with the pid alone let them write into one temporary
    file together and rename the mix into place."""
    path = Path(path)
    host = socket.gethostname().replace("/", "_")
    return path.with_name(f".{path.name}.tmp-{host}-{os.getpid()}-{os.urandom(4).hex()}")


def fsync_path(path: str | Path) -> None:
    """Flush a written file, or a directory's entries (after a rename into it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def exchange_paths(a: str | Path, b: str | Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``): a directory that replaces another
    is never missing in between, whenever the process dies. False where the C library or the filesystem cannot
    (another OS, an NFS mount): nothing was moved, the caller renames in two steps.

    Raises:
        OSError: The kernel refused for another reason (a missing path, no permission).
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def write_json_atomic(path: Path, obj: object) -> None:
    """Write JSON so a reader sees the old file or the new one, never a torn one."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` so a reader sees the old file or the new one, never a torn one (fsynced before the rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def sha256_file(path: str | Path, chunk: int = CHUNK) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def symlinks_under(root: str | Path) -> list[str]:
    """Every symbolic link under ``root`` (to a file, a folder or nothing; ``root`` itself aside), as sorted
    ``/``-separated names relative to it. A linked folder is listed, never entered."""
    root = Path(root)
    return sorted((Path(here) / name).relative_to(root).as_posix()
                  for here, folders, files in os.walk(root) for name in folders + files
                  if (Path(here) / name).is_symlink())


def tree_digest(files: dict[str, str]) -> str:
    """One digest over ``{relative name: sha256}`` (order-free): names and contents both count."""
    payload = json.dumps(sorted(files.items()), separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


class StatCache:
    """sha256 of files, remembered by (absolute path, size, mtime in ns) in one JSON file.

    Args:
        path: The cache file (created on first write; written atomically; a damaged one is ignored).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.hashed = 0
        """Files actually read by :meth:`sha256` (the rest were cache hits)."""
        try:
            self._entries: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._entries = {}
        if not isinstance(self._entries, dict) or not all(isinstance(e, dict) for e in self._entries.values()):
            self._entries = {}  # damaged (valid JSON of another shape): every file is hashed again

    def sha256(self, file: str | Path) -> str:
        """The file's sha256, from the cache while its size and mtime are unchanged."""
        file = Path(file).resolve()
        stat = file.stat()
        key = str(file)
        entry = self._entries.get(key)
        if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
            return str(entry["sha256"])
        digest = sha256_file(file)
        self.hashed += 1
        self._entries[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        self._save()
        return digest

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".stat-", dir=self.path.parent)
            with os.fdopen(fd, "w") as fh:
                json.dump(self._entries, fh)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache directory only costs a re-hash next time
