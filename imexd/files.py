"""Files on disk: atomic replace, and an in-place rewrite where a rename cannot work.

The IMEX daemon reads config.cfg and nodes_config.cfg only at start, and glibc reads the
hosts file on every lookup, so a reader must never see half a file: every file is
written to a temp file in the same folder, fsynced, renamed over the target, and the
folder fsynced (the reference driver writes /etc/hosts non-atomically). A file is
written only when its bytes change, so unchanged content keeps its inode and mtime.

Two deployments make the rename impossible for the hosts file: in a Kubernetes pod
/etc/hosts is a bind mount (rename over a mount point fails with EBUSY), and under
systemd's ProtectSystem=strict with ReadWritePaths=/etc/hosts only the file is
writable (the temp file cannot be created: EROFS). There `write_file` rewrites the
file in place, under an flock on the file, in one write, after keeping a backup of the
previous content; the result says which method was used, so a condition can tell.

Every failure is a FileWriteError that names the path and the step that failed; the
previous file is left intact and no temp file is left behind. The functions block
(fsync, lock wait): the agent calls them from a worker thread and retries a
FileWriteError with its backoff.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final, Literal

import msgspec

from imexd.errors import FileWriteError

TEMP_SUFFIX: Final = ".imexd-tmp"
BACKUP_SUFFIX: Final = ".imexd-bak"
BACKUP_MODE: Final = 0o600
"""Backups may hold anything the caller wrote: readable by their owner only."""

WriteMethod = Literal["rename", "in_place", "unchanged"]

_CREATE_DENIED: Final = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_RENAME_IMPOSSIBLE: Final = frozenset(
    {errno.EBUSY, errno.EXDEV, errno.EACCES, errno.EPERM, errno.EROFS}
)


class WriteResult(msgspec.Struct, frozen=True):
    """What `write_file` did."""

    changed: bool
    method: WriteMethod
    backup: Path | None = None
    """In place only: where the previous content was kept."""
    reason: str = ""
    """In place only: why the rename was impossible."""

    def describe(self, path: str | os.PathLike[str]) -> str:
        """One line for a log event or a condition message."""
        if self.method == "unchanged":
            return f"{path} unchanged"
        if self.method == "rename":
            return f"{path} replaced atomically"
        return f"{path} rewritten in place ({self.reason}); previous content kept at {self.backup}"


class _StepError(Exception):
    """An OSError together with the step of the write that raised it."""

    def __init__(self, kind: str, what: str, error: OSError) -> None:
        self.kind = kind
        self.what = what
        self.error = error
        super().__init__(self.describe())

    def describe(self) -> str:
        return f"{self.what}: {_os_reason(self.error)}"


def _os_reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


@contextlib.contextmanager
def _step(kind: str, what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise _StepError(kind, what, exc) from exc


def _encode(content: str | bytes) -> bytes:
    # surrogateescape: bytes that are not UTF-8 (read by read_text_or_empty) survive.
    return content if isinstance(content, bytes) else content.encode("utf-8", "surrogateescape")


def _target(path: str | os.PathLike[str]) -> Path:
    """The real file behind `path`: renaming over a symlink would replace the link."""
    return Path(os.path.realpath(path))


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FileWriteError(str(path), f"read the current file: {_os_reason(exc)}") from exc


def read_text_or_empty(path: str | os.PathLike[str]) -> str:
    """The file's text, or "" when it does not exist (a missing hosts file is empty).

    Bytes that are not UTF-8 are kept as surrogates, so writing the text back gives the
    same bytes. Any other read failure is a FileWriteError: the caller reads in order to
    rewrite the file, which it then cannot do.
    """
    data = _read_bytes(Path(path))
    return "" if data is None else data.decode("utf-8", "surrogateescape")


def remove_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove temp files a killed writer of `path` left behind; return what was removed.

    A write never leaves one behind unless its process dies inside it (SIGKILL, power
    loss). Call it at start, before any write of `path` is in flight.
    """
    target = _target(path)
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for stale in target.parent.glob(f".{glob.escape(target.name)}.*{TEMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                stale.unlink()
                removed.append(stale)
    return removed


def _write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        if offset is None:
            done += os.write(fd, view[done:])
        else:
            done += os.pwrite(fd, view[done:], offset + done)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(path: Path, data: bytes, mode: int) -> None:
    """Temp file in the same folder, write, fsync, rename, fsync the folder.

    Raises _StepError; the temp file is removed on every failure.
    """
    folder = path.parent
    with _step("create", f"create a temp file in {folder}"):
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=folder)
    try:
        with _step("write", f"write {tmp_name}"):
            try:
                os.fchmod(fd, mode)
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        with _step("rename", f"rename {tmp_name} over {path}"):
            os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    with _step("sync", f"fsync {folder}"):
        _fsync_dir(folder)


def write_atomic(path: str | os.PathLike[str], content: str | bytes, *, mode: int = 0o644) -> bool:
    """Replace the file atomically when its content changed; return whether it did.

    The new file gets exactly `mode` (the umask does not apply). No fallback: for
    files the daemon reads (config.cfg, nodes_config.cfg) a half-written file must
    never be visible. Raises FileWriteError; the previous file is then intact.
    """
    target = _target(path)
    data = _encode(content)
    if _read_bytes(target) == data:
        return False
    try:
        _replace(target, data, mode)
    except _StepError as exc:
        raise FileWriteError(str(path), exc.describe()) from exc.error
    return True


def write_file(
    path: str | os.PathLike[str],
    content: str | bytes,
    *,
    mode: int = 0o644,
    backup_dir: str | os.PathLike[str] | None = None,
    lock_timeout_s: float = 5.0,
) -> WriteResult:
    """Like write_atomic, but fall back to an in-place rewrite where rename cannot work.

    The fallback is taken only for an existing file whose folder refuses the temp file
    (EACCES, EPERM, EROFS) or whose rename fails because the target is a mount point
    or on another file system (EBUSY, EXDEV, ...). A full disk is not such a case: an
    in-place write could then leave half a file, so it is a FileWriteError. The backup
    goes next to the file (`<path>.imexd-bak`), else into `backup_dir`; with neither
    writable nothing is written. An in-place rewrite keeps the file's own mode and owner.
    """
    target = _target(path)
    data = _encode(content)
    current = _read_bytes(target)
    if current == data:
        return WriteResult(changed=False, method="unchanged")
    try:
        _replace(target, data, mode)
    except _StepError as exc:
        impossible = (exc.kind == "create" and exc.error.errno in _CREATE_DENIED) or (
            exc.kind == "rename" and exc.error.errno in _RENAME_IMPOSSIBLE
        )
        if current is None or not impossible:
            raise FileWriteError(str(path), exc.describe()) from exc.error
        return _rewrite_in_place(
            target,
            data,
            why=f"rename impossible: {exc.describe()}",
            backup_dir=None if backup_dir is None else Path(backup_dir),
            lock_timeout_s=lock_timeout_s,
        )
    return WriteResult(changed=True, method="rename")


def _lock(fd: int, path: Path, timeout_s: float) -> None:
    """Take an exclusive flock on the open file, waiting at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise FileWriteError(
                    str(path), f"locked by another process for {timeout_s:g} s"
                ) from None
            time.sleep(0.02)
        except OSError as exc:
            raise FileWriteError(str(path), f"lock: {_os_reason(exc)}") from exc


def _backup(path: Path, old: bytes, backup_dir: Path | None) -> Path:
    """Keep `old` next to the file, else in backup_dir; the first place that works."""
    places = [path.with_name(path.name + BACKUP_SUFFIX)]
    if backup_dir is not None:
        places.append(backup_dir / (path.name + BACKUP_SUFFIX))
    failures: list[str] = []
    for place in places:
        with contextlib.suppress(FileWriteError):
            if _read_bytes(place) == old:
                return place
        try:
            _replace(place, old, BACKUP_MODE)
        except _StepError as exc:
            failures.append(exc.describe())
            continue
        return place
    hint = "" if backup_dir is not None else "; give a writable backup folder"
    raise FileWriteError(str(path), "no backup could be kept: " + "; ".join(failures) + hint)


def _rewrite_in_place(
    path: Path, data: bytes, *, why: str, backup_dir: Path | None, lock_timeout_s: float
) -> WriteResult:
    """Rewrite an existing file through its own inode: lock, back up, one write, truncate."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise FileWriteError(
            str(path), f"{why}; in-place rewrite: open: {_os_reason(exc)}"
        ) from exc
    try:
        _lock(fd, path, lock_timeout_s)
        with _step("read", "read the current file"):
            old = _read_fd(fd)
        if old == data:
            return WriteResult(changed=False, method="unchanged")
        backup = _backup(path, old, backup_dir)
        try:
            # One write of the whole content, then cut what is left of a longer file:
            # a concurrent reader sees old or new lines, never an empty file.
            _write_all(fd, data, 0)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                _write_all(fd, old, 0)
                os.ftruncate(fd, len(old))
                os.fsync(fd)
            raise FileWriteError(
                str(path),
                f"{why}; in-place rewrite: {_os_reason(exc)}; previous content restored "
                f"(a copy is at {backup})",
            ) from exc
    except _StepError as exc:
        raise FileWriteError(str(path), f"{why}; in-place rewrite: {exc.describe()}") from exc
    finally:
        os.close(fd)  # also releases the flock
    return WriteResult(changed=True, method="in_place", backup=backup, reason=why)


def _read_fd(fd: int) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, 1 << 16, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)
