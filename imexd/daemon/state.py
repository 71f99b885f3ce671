"""The daemon supervisor's state model: states, reason codes and the status snapshot.

Pure data, no processes and no event loop: health, metrics and the agent read a
`DaemonStatus` without importing the supervisor's process machinery
(`imexd/daemon/supervisor.py`), and tests build one by hand. The states are supervisord's
(`STOPPED`, `STARTING`, `RUNNING`, `BACKOFF`, `STOPPING`, `FATAL`); the transitions
between them are the supervisor's and are documented there.
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec


class DaemonState(enum.Enum):
    """Where the daemon process is in its life (supervisord's process states)."""

    STOPPED = "STOPPED"
    """Not running and not about to run: not asked to, stopped, or blocked (see reason)."""
    STARTING = "STARTING"
    """Started, not yet READY, less than `start_s` ago."""
    RUNNING = "RUNNING"
    """Said READY, alive for at least `start_s`, or adopted."""
    BACKOFF = "BACKOFF"
    """Exited unexpectedly; waiting for the backoff delay before the next start."""
    STOPPING = "STOPPING"
    """SIGTERM sent; SIGKILL follows after `stop_timeout_s`."""
    FATAL = "FATAL"
    """Crash loop: waiting `fatal_cooldown_s` before one more start."""


class DaemonReason(enum.StrEnum):
    """Why the daemon is not RUNNING: the machine-readable word of `DaemonStatus.reason`."""

    STOPPED = "DaemonStopped"
    STARTING = "DaemonStarting"
    STOPPING = "DaemonStopping"
    CRASHED = "DaemonCrashed"
    START_FAILED = "DaemonStartFailed"
    CRASH_LOOP = "DaemonCrashLoop"
    CONFLICT = "ConflictingDaemon"


PROBLEMS: Final = frozenset(
    {
        DaemonReason.CRASHED,
        DaemonReason.START_FAILED,
        DaemonReason.CRASH_LOOP,
        DaemonReason.CONFLICT,
    }
)
"""The reasons that are problems, shown as they are as DaemonReady's reason (with the
supervisor's detail as its message); health names the ordinary states itself."""


class DaemonStatus(msgspec.Struct, frozen=True):
    """A snapshot of the supervisor, for health reports and readiness.

    `reason` is None only while RUNNING; otherwise it is a machine-readable code
    (`DaemonStopped`, `DaemonStarting`, `DaemonStopping`, `DaemonCrashed`,
    `DaemonStartFailed`, `DaemonCrashLoop`, `ConflictingDaemon`) and `detail` says the
    rest for a person, e.g. `exit 3 after 0.4 s, restart in 1 s; last lines: A | B | C`
    (the exited daemon's own last lines, never another's) or `cannot run
    /usr/bin/nvidia-imex: No such file or directory, retry in 1 s`. Two fields, so that
    health reads the code without parsing a sentence.
    """

    state: DaemonState
    pid: int | None
    adopted: bool
    """The daemon was started by a previous agent: exit code and output are unknown."""
    restarts: int
    """New daemons (spawned or adopted) that replaced one that had reached RUNNING and
    exited unplanned (a crash, a kill from outside).

    A planned end (a stop, a requested restart) followed by a start is no restart; a
    daemon that never ran does not make its successor a restart: see `start_failures`.
    """
    crashes: int
    """Unexpected exits (including failures to execute the binary)."""
    start_failures: int
    """Starts that never reached RUNNING: the binary could not run, or it exited in STARTING."""
    fatal_since: float | None
    """time.monotonic() since when the daemon is in a crash loop (FATAL, and the tries
    after each cool-down that failed again); None once a daemon reaches RUNNING or is
    stopped. How long the node has had no working daemon, e.g. to give up its slot."""
    last_exit: str | None
    """How the last daemon ended: `exit 3`, `SIGKILL`, `unknown (adopted)`, ..."""
    reason: DaemonReason | None
    detail: str
    """What happened, for a person (empty while RUNNING)."""
    since: float
    """Wall-clock time (Unix seconds) of the last change of state."""
    next_start_at: float | None
    """Wall-clock time of the next start attempt (BACKOFF, FATAL, blocked), else None."""
    reloads_sent: int
    reload_pending: bool
    """A SIGUSR1 is owed to the daemon and will be sent when its window ends."""
    last_lines: tuple[str, ...]
    """The last `daemon_output.LAST_LINES` lines of the running daemon's stdout and stderr,
    or of the last one that ran when none runs, oldest first; empty when the last start
    could not run the binary."""
    identified: int | None = None
    """The node id the running daemon logged (`Identified this node as ID <n>`); None
    before it did, without a daemon, or when its output is not read."""
