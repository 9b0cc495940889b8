"""The files a running server or front is told things by while it runs (its targets, its shadow, its route),
written by a rename over the old one and read again only when they changed."""

from __future__ import annotations

import os


class WatchedFile:
    """A file whose change (it appeared, was replaced or went) ``changed`` reports once: by its inode, mtime and
    size, so a rename over it (``replace_file``, a ConfigMap volume's swapped symlink) is a change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None

    def changed(self) -> bool:
        """Whether it changed since the last call that said so."""
        try:
            st = os.stat(self.path)  # follows a symlink
        except OSError:
            gone = self._seen is not None
            self._seen = None
            return gone
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return False
        self._seen = key
        return True

    def read(self) -> str | None:
        """Its text; None when there is no file."""
        try:
            with open(self.path) as handle:
                return handle.read()
        except FileNotFoundError:
            return None


def replace_file(path: str, data: bytes, *, sync: bool = False) -> None:
    """Replace ``path`` at once (write a sibling, then rename it over: a reader never sees half of it); ``sync``:
    on disk before the rename."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(data)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(temporary, path)
