"""Wake-ups when the daemon writes its output files: Linux inotify, through libc.

Regular files cannot be awaited with epoll; an inotify descriptor can. The supervisor
keeps one and watches the inodes of the files its daemon writes (`IN_MODIFY`), so it
reads them when the daemon wrote, not on a timer: a quiet daemon costs no wake-ups, and
its READY line is read the moment it is written. Where inotify is missing (another
kernel), or the user's instances are used up (`fs.inotify.max_user_instances`), `open`
raises OSError and the supervisor reads on its timer instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Final

IN_MODIFY: Final = 0x00000002
"""A write or a truncation of the watched file."""
_READ_BYTES: Final = 4096


class Inotify:
    """One inotify descriptor watching open files by their inode.

    `fileno()` becomes readable when a watched file was written; `drain()` empties it.
    Watches follow the file, not its name: they are set on `/proc/self/fd/N`.
    """

    def __init__(self, fd: int, libc: ctypes.CDLL) -> None:
        self._fd = fd
        self._libc = libc
        self._watches: set[int] = set()

    @classmethod
    def open(cls) -> Inotify:
        """A new non-blocking, close-on-exec descriptor; OSError when there is none."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init = libc.inotify_init1
        except (OSError, AttributeError) as exc:
            raise OSError(errno.ENOSYS, f"inotify is not available: {exc}") from None
        init.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        return cls(fd, libc)

    def fileno(self) -> int:
        return self._fd

    def watch(self, fd: int) -> None:
        """Watch the file open as `fd` for writes; OSError when it cannot be watched."""
        path = f"/proc/self/fd/{fd}".encode()
        wd = self._libc.inotify_add_watch(self._fd, path, IN_MODIFY)
        if wd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_add_watch: {os.strerror(code)}")
        self._watches.add(wd)

    def clear(self) -> None:
        """Remove every watch (one that is already gone with its file is skipped)."""
        for wd in self._watches:
            self._libc.inotify_rm_watch(self._fd, wd)
        self._watches.clear()

    def drain(self) -> None:
        """Read every pending event: what they say does not matter, only that one came."""
        try:
            while os.read(self._fd, _READ_BYTES):
                pass
        except BlockingIOError:
            return

    def close(self) -> None:
        """Close the descriptor, which removes its watches (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._watches.clear()
