"""The IMEX daemon's output files: created for a spawn, found for an adoption, tailed.

The daemon's stdout and stderr are files next to config.cfg (`nvidia-imex.out`,
`nvidia-imex.err`, opened O_APPEND), not pipes: whoever supervises the daemon, the
agent that started it or the one that adopted it after a hand-over, tails them and
logs each line as a `daemon.output` event, and no reader is needed for the daemon to
write (a pipe without one would kill it with SIGPIPE, or block it when full). A
spawn truncates them; when one grows past `max_bytes` it is truncated after it was
read to its end (the daemon's O_APPEND writes then start again at 0), so they stay
small even while no agent runs for long; a line written in the instant between that
last read and the truncation is lost. The supervisor reads them (`DaemonOutput.poll`)
when inotify says the daemon wrote (`imexd/daemon/inotify.py`), or every `output_poll_s`
where it cannot watch them.

Separate from the supervisor (`imexd/daemon/supervisor.py`) because reading, splitting, cutting
and truncating files is one job with its own edge cases, none of which is a decision
of the state machine: the supervisor only says which daemon's files to read and when.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from imexd.logs import get_logger

OUTPUT_SOURCE = "nvidia-imex"
"""The `source` field of every `daemon.output` event (a line of the daemon's output)."""

OUTPUT_FILES = {"stdout": "nvidia-imex.out", "stderr": "nvidia-imex.err"}
"""The daemon's output files, by stream, in `output_dir` (config.cfg's folder by default)."""

OUTPUT_MAX_BYTES = 4 * 1024 * 1024
"""An output file read to its end is truncated once it is larger than this."""

OUTPUT_POLL_S = 0.2
"""How often at most the output files are read for new lines (how often, without inotify)."""

OUTPUT_MODE = 0o640
"""The output files' permissions: the daemon's log is not for every local user."""

ADOPT_SEED_BYTES = 16 * 1024
"""How much of an adopted daemon's output files is read back into `last_lines`."""

STREAM_FDS = {"stdout": 1, "stderr": 2}
"""The daemon's file descriptor of each stream."""

LAST_LINES = 50
"""How many lines of each daemon's output are kept for status and error reasons."""

EXIT_LINES = 3
"""How many of an exited daemon's last lines its crash reason quotes."""

EXIT_LINE_CHARS = 240
"""A quoted line is cut there: the reason travels in health reports of bounded size."""

MAX_LINE_BYTES = 16 * 1024
"""A longer line is cut there: one runaway line must not grow the agent's memory."""


class ImexLine(msgspec.Struct, frozen=True):
    """One line of daemon output, split into structlog level and message."""

    level: str
    """debug, info, warning, error or critical."""
    message: str
    imex_time: str | None = None
    tid: int | None = None


_IMEX_LINE = re.compile(
    r"^\[(?P<time>[A-Z][a-z]{2} +\d{1,2} \d{4} \d{2}:\d{2}:\d{2}(?:\.\d+)?)\] "
    r"\[(?P<level>[A-Za-z]+)\] \[tid (?P<tid>\d+)\] ?(?P<message>.*)$"
)
_PREFIXED_LINE = re.compile(
    r"^(?P<level>INFO|WARNING|WARN|ERROR|DEBUG|FATAL|CRITICAL|NOTICE): ?(?P<message>.*)$"
)
_IDENTIFIED = re.compile(r"\bIdentified this node as ID (?P<id>\d+)\b")
"""IMEX's start-up line naming its own node id (its line in nodes_config.cfg)."""
_STATE_CHANGED = re.compile(
    r"\b(?i:daemon state changed from) (?P<old>[A-Z_]+) (?i:to) (?P<new>[A-Z_]+)\b"
)
"""The daemon's line naming its own new state word (the simulator's wording,
`IMEX daemon state changed from INIT_GPU to READY`): a peer's state, or READY anywhere
else in a line, is not it."""
_LEVELS = {
    "TRACE": "debug",
    "VERBOSE": "debug",
    "DEBUG": "debug",
    "INFO": "info",
    "NOTICE": "info",
    "WARN": "warning",
    "WARNING": "warning",
    "ERROR": "error",
    "FATAL": "critical",
    "CRITICAL": "critical",
}


def parse_imex_line(line: str) -> ImexLine:
    """Read IMEX's `[Sep 18 2026 06:40:33] [INFO] [tid 77] message` format.

    Also `WARNING: ...`-prefixed lines (printed before logging is set up); anything
    else is an info-level message as it is.
    """
    m = _IMEX_LINE.match(line)
    if m is not None:
        return ImexLine(
            _LEVELS.get(m["level"].upper(), "info"), m["message"], m["time"], int(m["tid"])
        )
    m = _PREFIXED_LINE.match(line)
    if m is not None:
        return ImexLine(_LEVELS[m["level"]], m["message"])
    return ImexLine("info", line)


def says_ready(message: str) -> bool:
    """Whether a message is the daemon's own word that its state changed to READY.

    Only the state word after `to` counts, whole (not `READY_...`): a line that merely
    mentions READY, or a change away from it, does not.
    """
    m = _STATE_CHANGED.search(message)
    return m is not None and m["new"] == "READY"


def identified_id(message: str) -> int | None:
    """The node id of IMEX's `Identified this node as ID <n>` line, else None."""
    m = _IDENTIFIED.search(message)
    return int(m["id"]) if m is not None else None


class Stream:
    """The read end of one of the daemon's output files, split into lines."""

    def __init__(self, fd: int, stream: str, path: str) -> None:
        self.fd = fd
        self.stream = stream
        self.path = path
        self.buf = bytearray()
        self.open = True

    def close(self) -> None:
        """Close the read end (idempotent)."""
        if self.open:
            self.open = False
            os.close(self.fd)


class Tail:
    """The output files of one daemon being read; empty when they are not ours (adopted)."""

    def __init__(self, pid: int, streams: list[Stream]) -> None:
        self.pid = pid
        self.streams = streams
        self.lines: deque[str] = deque(maxlen=LAST_LINES)
        """Its own last lines of output (both streams, in the order read), oldest first:
        never another daemon's, so a reason quoting them is about this daemon."""
        self.last_stderr: str | None = None
        """Its last line on stderr: why it exited, most often."""
        self.identified: int | None = None
        """The node id it logged at start (`Identified this node as ID <n>`): its own idea
        of its line in nodes_config.cfg. None until read (or, adopted, when that line is
        no longer in the end of its output read back)."""

    def close(self) -> None:
        """Close every stream (idempotent)."""
        for stream in self.streams:
            stream.close()


class DaemonOutput:
    """The output files in one folder, read for whichever daemon writes to them.

    `create` opens fresh files for a spawn, `adopt` finds those an adopted daemon
    writes to, `poll` and `read` log what was written since; each daemon's `Tail`
    keeps its last `LAST_LINES` lines for the status and error reasons. `on_lines` is
    called after a read that found new lines (in the event loop, must not block), with
    whether one of them says the daemon is READY (`says_ready`).
    """

    def __init__(self, folder: str, *, max_bytes: int, on_lines: Callable[[bool], None]) -> None:
        self.paths = {stream: os.path.join(folder, name) for stream, name in OUTPUT_FILES.items()}
        """The output files by stream (`stdout`, `stderr`)."""
        self._max = max_bytes
        self._on_lines = on_lines
        self._count = 0
        self._ready = False
        """A line read since the last `on_lines` said the daemon is READY."""
        self._log = get_logger("daemon")

    def create(self, stream: str) -> tuple[int, Stream] | None:
        """Truncate `stream`'s file for a new daemon: (its write end, our reader), or None.

        Without its file the daemon's stream goes to /dev/null: a run dir we cannot
        write to must not keep IMEX from starting, only its output from being read.
        """
        path = self.paths[stream]
        flags = os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            writer = os.open(path, os.O_WRONLY | flags, OUTPUT_MODE)
            try:
                reader = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                os.close(writer)
                raise
        except OSError as exc:
            self._log.error(
                "daemon.output_unavailable",
                stream=stream,
                path=path,
                error=str(exc),
                consequence="this stream of the daemon goes to /dev/null",
            )
            return None
        return writer, Stream(reader, stream, path)

    def adopt(self, pid: int) -> Tail:
        """Readers of our output files that daemon `pid` writes to, at their end.

        A daemon started by an older agent, or by hand, writes elsewhere: nothing to
        tail. The end of each file is read back into its `lines` (not logged again).
        """
        streams: list[Stream] = []
        seeded: list[str] = []
        identified: int | None = None
        for stream, path in self.paths.items():
            try:
                theirs = os.stat(f"/proc/{pid}/fd/{STREAM_FDS[stream]}")
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                ours = os.fstat(fd)
                if (ours.st_dev, ours.st_ino) != (theirs.st_dev, theirs.st_ino):
                    os.close(fd)
                    continue
                end = os.lseek(fd, 0, os.SEEK_END)
                start = max(0, end - ADOPT_SEED_BYTES)
                tail = os.pread(fd, end - start, start)
            except OSError:
                os.close(fd)
                continue
            lines = tail.split(b"\n")[:-1]  # the last one is unfinished (or empty)
            if start > 0:
                lines = lines[1:]  # the first one is cut
            for raw in lines:
                line = raw.decode("utf-8", errors="replace").rstrip("\r")
                if line.strip():
                    seeded.append(line)
                    said = identified_id(parse_imex_line(line).message)
                    identified = said if said is not None else identified
            streams.append(Stream(fd, stream, path))
        adopted = Tail(pid, streams)
        adopted.lines.extend(seeded)
        adopted.identified = identified
        return adopted

    def describe(self, tail: Tail) -> str:
        """Whether an adopted daemon's output is streamed, for its `daemon.adopted` event."""
        if not tail.streams:
            return "not streamed: its stdout/stderr are not " + " and ".join(self.paths.values())
        if len(tail.streams) < len(self.paths):
            return f"streamed: only {tail.streams[0].stream}"
        return "streamed"

    def poll(self, tail: Tail) -> None:
        """Log the whole lines written since the last read, each file on its own."""
        for stream in tail.streams:
            try:
                self.read(tail, stream, final=False)
            except Exception:  # a bug here must not end the daemon's supervision
                self._log.exception("daemon.output_failed", path=stream.path)

    def read_all(self, tail: Tail, *, final: bool) -> None:
        """`read` every stream of `tail`."""
        for stream in tail.streams:
            self.read(tail, stream, final=final)

    def read(self, tail: Tail, stream: Stream, *, final: bool) -> None:
        """Log the whole lines written since the last read; truncate a file grown too big.

        `final` (the daemon exited): also the last, unfinished line.
        """
        if not stream.open:
            return
        try:
            if os.fstat(stream.fd).st_size < os.lseek(stream.fd, 0, os.SEEK_CUR):
                os.lseek(stream.fd, 0, os.SEEK_SET)  # truncated by someone else
            at_end = False
            emitted = self._count
            for _ in range(64):  # at most 4 MiB at a time: the loop must not stall
                data = os.read(stream.fd, 65536)
                if not data:
                    at_end = True
                    break
                self._split(tail, stream, data)
            if final and stream.buf:
                self._emit(tail, stream.stream, bytes(stream.buf))
                stream.buf.clear()
            if self._count != emitted:
                ready, self._ready = self._ready, False
                self._on_lines(ready)
            if at_end and not final:
                pos = os.lseek(stream.fd, 0, os.SEEK_CUR)
                if pos > self._max:
                    self._truncate(stream, pos)
        except OSError as exc:
            self._log.error(
                "daemon.output_unreadable", stream=stream.stream, path=stream.path, error=str(exc)
            )
            stream.close()

    def _split(self, tail: Tail, stream: Stream, data: bytes) -> None:
        stream.buf += data
        while (nl := stream.buf.find(b"\n")) >= 0:
            line = bytes(stream.buf[:nl])
            del stream.buf[: nl + 1]
            self._emit(tail, stream.stream, line)
        if len(stream.buf) > MAX_LINE_BYTES:
            self._emit(tail, stream.stream, bytes(stream.buf[:MAX_LINE_BYTES]) + b" [cut]")
            stream.buf.clear()

    def _truncate(self, stream: Stream, size: int) -> None:
        """Empty an output file read to its end; the daemon's O_APPEND writes restart at 0."""
        ours = os.fstat(stream.fd)
        try:
            there = os.stat(stream.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (there.st_dev, there.st_ino) != (ours.st_dev, ours.st_ino):
            return  # replaced: not the daemon's file any more
        try:
            os.truncate(stream.path, 0)
        except OSError as exc:
            self._log.warning("daemon.output_truncate_failed", path=stream.path, error=str(exc))
            return
        os.lseek(stream.fd, 0, os.SEEK_SET)
        self._log.debug("daemon.output_truncated", path=stream.path, size=size)

    def _emit(self, tail: Tail, stream: str, raw: bytes) -> None:
        """One line of daemon output: kept for reasons and logged as a `daemon.output` event."""
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line.strip():
            return
        tail.lines.append(line)
        self._count += 1
        if stream == "stderr":
            tail.last_stderr = line
        parsed = parse_imex_line(line)
        said = identified_id(parsed.message)
        if said is not None:
            tail.identified = said
        if says_ready(parsed.message):
            self._ready = True
        extra: dict[str, Any] = {}
        if parsed.tid is not None:
            extra["tid"] = parsed.tid
            extra["imex_time"] = parsed.imex_time
        log = getattr(self._log, parsed.level)
        log(
            "daemon.output",
            line=parsed.message,
            source=OUTPUT_SOURCE,
            stream=stream,
            pid=tail.pid,
            **extra,
        )


def quote_lines(lines: Sequence[str], count: int = EXIT_LINES) -> str:
    """The last `count` of a daemon's lines for a reason: IMEX's time and tid dropped.

    `[Sep 18 2026 06:40:33] [ERROR] [tid 7] boom` reads `[ERROR] boom`; other lines as
    they are; each cut at `EXIT_LINE_CHARS`; joined with " | ", oldest first.
    """
    quoted: list[str] = []
    for line in list(lines)[-count:] if count > 0 else []:
        m = _IMEX_LINE.match(line)
        text = f"[{m['level']}] {m['message']}" if m is not None else line.strip()
        if len(text) > EXIT_LINE_CHARS:
            text = text[: EXIT_LINE_CHARS - 3] + "..."
        quoted.append(text)
    return " | ".join(quoted)
