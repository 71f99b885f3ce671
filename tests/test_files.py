"""Files on disk: atomic replace, in-place fallback, and failures on real file systems.

Read-only folders, full disks and bind mounts are real: tmpfs and bind mounts made by
`mount` when running as root (as in CI); those tests are skipped otherwise, or when the
sandbox does not permit mounting, with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from imexd.errors import FileWriteError
from imexd.files import (
    BACKUP_SUFFIX,
    TEMP_SUFFIX,
    WriteResult,
    read_text_or_empty,
    remove_stale_temps,
    write_atomic,
    write_file,
)

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not IS_ROOT, reason="needs root to mount tmpfs and bind mounts (CI runs as root)"
)
needs_non_root = pytest.mark.skipif(
    IS_ROOT, reason="root ignores permission bits; the root variant uses real mounts"
)


def _temps(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX)]


_NOT_PERMITTED = ("permission denied", "not permitted", "must be superuser", "read-only")


def _mount(*args: str) -> None:
    """Run `mount ARGS`; skip when the sandbox forbids mounting, fail on any other error."""
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return
    message = f"mount {' '.join(args)}: {proc.stderr.strip() or proc.returncode}"
    if any(word in proc.stderr.lower() for word in _NOT_PERMITTED):
        pytest.skip(f"mounting is not permitted in this sandbox ({message})")
    pytest.fail(message)


def _umount(target: Path) -> None:
    proc = subprocess.run(["umount", str(target)], capture_output=True, check=False)
    if proc.returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


@contextlib.contextmanager
def mounted(target: Path, *args: str) -> Iterator[Path]:
    """`mount ARGS TARGET` for the duration of the block, always unmounted after."""
    _mount(*args, str(target))
    try:
        yield target
    finally:
        _umount(target)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "etc"
    path.mkdir()
    return path


# Plain behaviour


def test_write_creates_the_file_with_mode_0644(folder: Path) -> None:
    """A new file gets its content and mode 0644 whatever the umask."""
    old_umask = os.umask(0o077)
    try:
        assert write_atomic(folder / "config.cfg", "A=1\n") is True
    finally:
        os.umask(old_umask)
    path = folder / "config.cfg"
    assert path.read_text() == "A=1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert _temps(folder) == []


def test_replace_resets_the_mode_to_0644(folder: Path) -> None:
    """Replacing a file with another mode leaves a 0644 file (our files are 0644)."""
    path = folder / "nodes_config.cfg"
    path.write_text("old\n")
    path.chmod(0o600)
    assert write_file(path, "new\n") == WriteResult(changed=True, method="rename")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_unchanged_content_is_not_written(folder: Path) -> None:
    """Same bytes: no write at all, so inode and mtime stay the same."""
    path = folder / "config.cfg"
    write_atomic(path, "A=1\n")
    before = path.stat()
    assert write_atomic(path, "A=1\n") is False
    assert write_file(path, b"A=1\n") == WriteResult(changed=False, method="unchanged")
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_content_replaces_the_inode(folder: Path) -> None:
    """A change is a rename: readers holding the old file keep reading the old bytes."""
    path = folder / "config.cfg"
    write_atomic(path, "A=1\n")
    with path.open() as reader:
        assert write_atomic(path, "A=2\n") is True
        assert reader.read() == "A=1\n"
    assert path.read_text() == "A=2\n"
    assert _temps(folder) == []


def test_symlink_is_followed_not_replaced(folder: Path) -> None:
    """Writing through a symlink updates its target and keeps the link."""
    real = folder / "real-hosts"
    real.write_text("old\n")
    link = folder / "hosts"
    link.symlink_to(real)
    assert write_file(link, "new\n").method == "rename"
    assert link.is_symlink()
    assert real.read_text() == "new\n"
    assert _temps(folder) == []


def test_non_utf8_bytes_round_trip(folder: Path) -> None:
    """Text read with read_text_or_empty writes back the very same bytes."""
    path = folder / "hosts"
    path.write_bytes(b"10.0.0.9 caf\xe9\n")
    text = read_text_or_empty(path)
    assert write_file(path, text).method == "unchanged"
    write_file(path, text + "x\n")
    assert path.read_bytes() == b"10.0.0.9 caf\xe9\nx\n"


def test_read_missing_file_is_empty(folder: Path) -> None:
    """A missing file reads as empty text."""
    assert read_text_or_empty(folder / "absent") == ""


def test_read_failure_is_a_file_write_error(folder: Path) -> None:
    """A path that cannot be read (here a folder) is a FileWriteError naming it."""
    with pytest.raises(FileWriteError, match="read the current file"):
        read_text_or_empty(folder)


def test_missing_folder_is_a_file_write_error(tmp_path: Path) -> None:
    """A write into a folder that does not exist fails cleanly, naming the step."""
    with pytest.raises(FileWriteError, match="create a temp file") as info:
        write_file(tmp_path / "nope" / "config.cfg", "A=1\n")
    assert info.value.path == str(tmp_path / "nope" / "config.cfg")


def test_remove_stale_temps_removes_only_our_leftovers(folder: Path) -> None:
    """Leftovers of a killed writer of this file go; other files and temps stay."""
    path = folder / "config.cfg"
    path.write_text("A=1\n")
    stale = folder / f".config.cfg.abc123{TEMP_SUFFIX}"
    other = folder / f".nodes_config.cfg.abc123{TEMP_SUFFIX}"
    stale.write_text("half")
    other.write_text("half")
    assert remove_stale_temps(path) == [stale]
    assert sorted(p.name for p in folder.iterdir()) == sorted([path.name, other.name])


def test_describe_says_what_happened() -> None:
    """WriteResult.describe gives one line for each method."""
    assert WriteResult(False, "unchanged").describe("/x") == "/x unchanged"
    assert WriteResult(True, "rename").describe("/x") == "/x replaced atomically"
    line = WriteResult(True, "in_place", Path("/x.imexd-bak"), "EBUSY").describe("/x")
    assert line == "/x rewritten in place (EBUSY); previous content kept at /x.imexd-bak"


# Failures on real file systems


@pytest.fixture
def readonly_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder on a read-only tmpfs holding `hosts` with "old\\n" (and nothing writable)."""
    if not IS_ROOT:
        pytest.skip("needs root to mount a read-only tmpfs (CI runs as root)")
    target = tmp_path / "ro"
    target.mkdir()
    with mounted(target, "-t", "tmpfs", "-o", "size=1m", "tmpfs"):
        (target / "hosts").write_text("old\n")
        _mount("-o", "remount,ro", str(target))
        yield target


@needs_root
@pytest.mark.root
def test_read_only_folder_fails_and_keeps_the_old_file(readonly_folder: Path) -> None:
    """On a read-only file system both writers raise FileWriteError and change nothing."""
    path = readonly_folder / "hosts"
    with pytest.raises(FileWriteError, match="EROFS"):
        write_atomic(path, "new\n")
    with pytest.raises(FileWriteError, match=r"in-place rewrite: open: .*EROFS"):
        write_file(path, "new\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in readonly_folder.iterdir()) == ["hosts"]


@needs_root
@pytest.mark.root
def test_full_disk_fails_and_leaves_no_temp(tmp_path: Path) -> None:
    """A full tmpfs: FileWriteError (ENOSPC), old file intact, no temp file, no fallback."""
    target = tmp_path / "full"
    target.mkdir()
    with mounted(target, "-t", "tmpfs", "-o", "size=64k", "tmpfs"):
        path = target / "config.cfg"
        path.write_text("old\n")
        with contextlib.suppress(OSError), (target / "filler").open("wb", buffering=0) as fh:
            while True:
                fh.write(b"\0" * 4096)
        for writer in (write_atomic, write_file):
            with pytest.raises(FileWriteError, match="ENOSPC"):
                writer(path, "new content\n" * 100)
            assert path.read_text() == "old\n"
            assert _temps(target) == []
            assert not (target / ("config.cfg" + BACKUP_SUFFIX)).exists()


@pytest.fixture
def bind_mounted_hosts(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(hosts, source): `hosts` in a writable folder is a bind mount of `source`."""
    if not IS_ROOT:
        pytest.skip("needs root to bind-mount a file (CI runs as root)")
    source = tmp_path / "source-hosts"
    source.write_text("127.0.0.1 localhost\n10.0.0.9 a-long-line-that-will-be-cut\n")
    etc = tmp_path / "etc"
    etc.mkdir()
    hosts = etc / "hosts"
    hosts.touch()
    with mounted(hosts, "--bind", str(source)):
        yield hosts, source


@needs_root
@pytest.mark.root
def test_bind_mounted_file_is_rewritten_in_place(bind_mounted_hosts: tuple[Path, Path]) -> None:
    """A bind-mounted hosts file (a pod's /etc/hosts): rename fails, in-place works."""
    hosts, source = bind_mounted_hosts
    old = hosts.read_text()
    inode = hosts.stat().st_ino
    result = write_file(hosts, "127.0.0.1 localhost\n")
    assert result.changed
    assert result.method == "in_place"
    assert "EBUSY" in result.reason
    assert result.backup == hosts.with_name("hosts" + BACKUP_SUFFIX)
    assert result.backup.read_text() == old
    assert stat.S_IMODE(result.backup.stat().st_mode) == 0o600
    assert hosts.read_text() == source.read_text() == "127.0.0.1 localhost\n"
    assert hosts.stat().st_ino == inode
    assert _temps(hosts.parent) == []
    assert write_file(hosts, "127.0.0.1 localhost\n").method == "unchanged"


@needs_root
@pytest.mark.root
def test_write_atomic_refuses_a_bind_mount(bind_mounted_hosts: tuple[Path, Path]) -> None:
    """write_atomic has no fallback: EBUSY is a FileWriteError and nothing changes."""
    hosts, source = bind_mounted_hosts
    old = source.read_text()
    with pytest.raises(FileWriteError, match="EBUSY"):
        write_atomic(hosts, "new\n")
    assert hosts.read_text() == old
    assert _temps(hosts.parent) == []


@pytest.fixture
def only_file_writable(tmp_path: Path) -> Iterator[Path]:
    """`hosts` is writable but its folder is not (systemd ProtectSystem=strict style).

    As root: the folder is a read-only bind mount and the file a writable bind mount on
    top of it, as systemd sets up ReadWritePaths=. Otherwise: the folder is chmod 0555.
    """
    etc = tmp_path / "etc"
    etc.mkdir()
    hosts = etc / "hosts"
    hosts.write_text("old hosts\n")
    if not IS_ROOT:
        etc.chmod(0o555)
        try:
            yield hosts
        finally:
            etc.chmod(0o755)
        return
    source = tmp_path / "writable-hosts"
    source.write_text("old hosts\n")
    with mounted(etc, "--bind", str(etc)):
        _mount("-o", "remount,bind,ro", str(etc))
        with mounted(hosts, "--bind", str(source)):
            yield hosts


def test_only_file_writable_needs_a_backup_place(only_file_writable: Path) -> None:
    """Without a writable place for the backup nothing is written, and the error says so."""
    with pytest.raises(FileWriteError, match="no backup could be kept"):
        write_file(only_file_writable, "new hosts\n")
    assert only_file_writable.read_text() == "old hosts\n"


def test_only_file_writable_is_rewritten_in_place(only_file_writable: Path, tmp_path: Path) -> None:
    """Only the file writable: in-place rewrite, backup in the given backup folder."""
    state = tmp_path / "state"
    state.mkdir()
    result = write_file(only_file_writable, "new hosts\n", backup_dir=state)
    assert result.method == "in_place"
    assert result.backup == state / ("hosts" + BACKUP_SUFFIX)
    assert result.backup.read_text() == "old hosts\n"
    assert only_file_writable.read_text() == "new hosts\n"
    assert _temps(only_file_writable.parent) == []


def test_in_place_waits_for_the_lock_then_gives_up(
    only_file_writable: Path, tmp_path: Path
) -> None:
    """Another holder of the file's flock makes the rewrite fail after the timeout."""
    with only_file_writable.open("rb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        with pytest.raises(FileWriteError, match="locked by another process"):
            write_file(only_file_writable, "new\n", backup_dir=tmp_path, lock_timeout_s=0.1)
    assert only_file_writable.read_text() == "old hosts\n"


def test_missing_file_in_unwritable_folder_fails(only_file_writable: Path) -> None:
    """No file to rewrite in place and no folder to create it in: FileWriteError."""
    with pytest.raises(FileWriteError, match="create a temp file"):
        write_file(only_file_writable.with_name("other"), "x\n")


@needs_non_root
def test_read_only_folder_as_non_root(tmp_path: Path) -> None:
    """Non-root: a 0555 folder refuses write_atomic and keeps the old file."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "config.cfg").write_text("old\n")
    etc.chmod(0o555)
    try:
        with pytest.raises(FileWriteError, match="EACCES"):
            write_atomic(etc / "config.cfg", "new\n")
        assert (etc / "config.cfg").read_text() == "old\n"
        assert _temps(etc) == []
    finally:
        etc.chmod(0o755)
