"""What the demo shows: the table of nodes, its colours, and the terminal it is drawn on.

Pure rendering of what the scenario knows (each agent's HealthReport, how its processes
are), in columns two spaces apart like every table imexd prints, but of fixed widths:
the table is redrawn several times a second and must not jump. On a terminal it is
redrawn in place; elsewhere only what changed is printed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Final, TextIO

from imexd.messages import HealthReport, failing

HEADLINE_EVERY_S: Final = 1.0
"""Without a terminal a changed headline is printed at most this often."""
NOTE_INDENT: Final = " " * 6
"""Where a note put below its row starts (under NODE)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One node's line of the table: what its agent reports and how its processes are."""

    node: str
    address: str
    agent: str
    """starting, up, down (killed by the demo), leaving, left, exited."""
    report: HealthReport | None
    """Its agent's last `/status`; only read while the agent is starting or up: an agent
    that was killed or left reports nothing any more, whatever it said last."""
    orphan_pid: int | None = None
    """The daemon's pid while its agent is down and the daemon runs on alone (checked)."""
    stopped: bool = False
    """The agent left cleanly and no process of the node is left: its daemon stopped."""

    @property
    def live(self) -> HealthReport | None:
        """The report, if the agent is there to stand by it."""
        return self.report if self.agent in ("starting", "up") else None


HEADER: Final = ("SLOT", "NODE", "ADDRESS", "AGENT", "DAEMON", "PID", "IMEX", "READY", "SEES")
WIDEST: Final[dict[str, int]] = {
    "AGENT": len("starting"),  # starting, up, down, leaving, left, exited
    "DAEMON": len("STARTING"),  # the supervisor's states: STOPPED ... FATAL
    "PID": len("4194304"),  # the largest pid_max Linux allows
    "IMEX": len("WAITING_FOR_RECOVERY"),  # the longest word of `nvidia-imex-ctl -q`
    "READY": len("READY"),
    "SEES": len("DEGRADED"),  # UP, DEGRADED, DOWN, FORMING, UNKNOWN
}
"""The widest word each column can hold, so that no frame moves a column: the run's node
names and addresses are known from its start, every other cell is one of these words."""
LAYOUTS: Final = (HEADER, tuple(c for c in HEADER if c != "ADDRESS"))
LAYOUTS_NARROW: Final = tuple(c for c in HEADER if c not in ("ADDRESS", "PID"))
"""Narrower terminals drop ADDRESS (the headline names the addresses) and then PID (the
events name the pids): the first layout that fits the width is kept for the whole run."""
NOTE_MIN: Final = 24
"""Columns a note needs beside its row; with fewer, notes go below their rows."""
GREEN: Final = frozenset({"UP", "READY", "RUNNING", "up", "yes"})
YELLOW: Final = frozenset(
    {"FORMING", "STARTING", "STOPPING", "INITIALIZING", "STARTING_AUTH_SERVER", "INIT_GPU"}
    | {"WAITING_FOR_PEERS", "WAITING_FOR_RECOVERY", "starting", "leaving", "left", "STOPPED"}
    | {"LEAVING", "UNKNOWN"}
)
RED: Final = frozenset({"DEGRADED", "DOWN", "BACKOFF", "FATAL", "UNAVAILABLE", "down", "exited"})
NOTE_MAX: Final = 60
PAINTED: Final = frozenset({"AGENT", "DAEMON", "PID", "IMEX", "READY", "SEES"})
"""The columns whose words are coloured (not the names, not the note)."""


def _cells(row: Row) -> dict[str, str]:
    r = row.live
    base = {"NODE": row.node, "ADDRESS": row.address, "AGENT": row.agent}
    if r is None:
        daemon, pid = "-", "-"
        if row.orphan_pid:
            daemon, pid = "RUNNING", str(row.orphan_pid)
        elif row.stopped:
            daemon = "STOPPED"
        unknown = dict.fromkeys(("SLOT", "IMEX", "READY", "SEES"), "-")
        return base | unknown | {"DAEMON": daemon, "PID": pid}
    return base | {
        "SLOT": "-" if r.slot is None else str(r.slot),
        "DAEMON": r.daemon.state or "-",
        "PID": "-" if r.daemon.pid is None else str(r.daemon.pid),
        "IMEX": r.daemon.imex_status or "-",
        "READY": "yes" if r.ready else "no",
        "SEES": (r.domain_view.status if r.domain_view is not None else "") or "-",
    }


def _note(row: Row) -> str:
    r = row.live
    if r is None:
        if row.orphan_pid:
            return "IMEX keeps running without its agent"
        return "left the domain; its daemon stopped" if row.stopped else ""
    parts = []
    restarts = r.daemon.restarts
    if restarts:
        parts.append(f"{restarts} restart{'s' if restarts > 1 else ''}")
    unmet = failing(r.conditions)
    if not r.ready and unmet:
        cond = unmet[0]
        parts.append(f"{cond.reason}: {cond.message}" if cond.message else cond.reason)
    note = "; ".join(parts)
    return note if len(note) <= NOTE_MAX else note[: NOTE_MAX - 3] + "..."


def paint(text: str, word: str, *, color: bool) -> str:
    """`text` in the colour of `word` (green: fine, yellow: on its way, red: broken)."""
    if not color:
        return text
    code = "32" if word in GREEN else "33" if word in YELLOW else "31" if word in RED else ""
    return f"\x1b[{code}m{text}\x1b[0m" if code else text


def _widths(rows: Sequence[Row]) -> dict[str, int]:
    """Each column's width for the whole run: the widest word it can hold."""
    fixed = {name: max(len(name), WIDEST.get(name, 0)) for name in HEADER}
    fixed["SLOT"] = max(len("SLOT"), len(str(max(len(rows) - 1, 0))))
    fixed["NODE"] = max([len("NODE"), *(len(r.node) for r in rows)])
    fixed["ADDRESS"] = max([len("ADDRESS"), *(len(r.address) for r in rows)])
    return fixed


def _layout(widths: dict[str, int], width: int) -> tuple[str, ...]:
    """The columns shown: every one without a width, else the first layout that fits."""
    for columns in (*LAYOUTS, LAYOUTS_NARROW):
        if not width or sum(widths[c] for c in columns) + 2 * (len(columns) - 1) <= width:
            return columns
    return LAYOUTS_NARROW


def _fit(cell: str, width: int) -> str:
    """A cell cut to its column (a word no column was sized for), so nothing moves."""
    return cell if len(cell) <= width else cell[: width - 1] + "…"


def table_lines(rows: Sequence[Row], *, color: bool = False, width: int = 0) -> list[str]:
    """The table, one string per line. Its columns keep their places and widths for the
    whole run: node names and addresses come from the rows, every other column is as wide
    as the widest word it can hold, and `width` (> 0: a terminal) only picks which
    columns fit. A note goes beside its row when it fits there, else below it, wrapped
    between words; a line that still does not fit is cut."""
    widths = _widths(rows)
    columns = _layout(widths, width)
    used = sum(widths[c] for c in columns) + 2 * (len(columns) - 1)
    room = width - used - 2 if width else NOTE_MAX
    beside = room >= NOTE_MIN

    def line(cells: dict[str, str], note: str, *, paint_words: bool) -> str:
        parts = []
        for name in columns:
            cell = _fit(cells[name], widths[name])
            padded = cell.ljust(widths[name])
            if paint_words and name in PAINTED:
                padded = paint(cell, cell, color=True) + padded[len(cell) :]
            parts.append(padded)
        if note:
            parts.append(note)
        return "  ".join(parts).rstrip()

    header = {name: name for name in HEADER}
    lines = [line(header, "NOTE" if beside else "", paint_words=False)]
    for row in rows:
        note = _note(row)
        here = note if beside and len(note) <= room else ""
        lines.append(line(_cells(row), here, paint_words=color))
        if note and not here:
            lines += textwrap.wrap(
                note,
                width or 1000,
                initial_indent=NOTE_INDENT,
                subsequent_indent=NOTE_INDENT,
            )
    if not width:
        return lines
    return [_cut(text, width) for text in lines]


def _cut(text: str, width: int) -> str:
    """A line cut to `width` visible columns (colour codes do not count)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    if len(plain) <= width:
        return text
    return plain[: width - 1] + "…"


def wrap_event(text: str, width: int) -> list[str]:
    """An event line wrapped between words to `width` (> 0), the rest indented under its
    text (past the `[  12.3 s] ` stamp); as it is without a width."""
    if width <= 0 or len(text) <= width:
        return [text]
    indent = " " * (text.index("] ") + 2) if text.startswith("[") and "] " in text else "  "
    return textwrap.wrap(text, width, subsequent_indent=indent) or [text]


def headline(
    elapsed: float, domain: str, state: str, detail: str, *, color: bool, width: int
) -> str:
    """`[  12.3 s] domain "demo": UP - ...`, cut to `width` (> 0), the state coloured."""
    head = f'[{elapsed:6.1f} s] domain "{domain}": {state} - {detail}'
    if width and len(head) > width:
        head = head[: width - 1] + "…"
    if color:
        head = head.replace(f": {state} ", f": {paint(state, state, color=True)} ", 1)
    return head


class Screen:
    """Events scroll, the table stays below them and is redrawn in place on a terminal.
    Elsewhere (a pipe, a CI log) nothing is redrawn: the headline is printed when the
    domain's state or reason changes (at most once a second), and the table at the
    story's milestones when it changed since it was last printed."""

    def __init__(
        self,
        out: TextIO,
        *,
        tty: bool,
        color: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.tty = tty
        self.color = color
        self.clock = clock
        """Seconds, for the pace of headlines without a terminal (tests pass their own)."""
        self._frame: list[str] = []
        self._drawn = 0
        self._printed_table: tuple[tuple[str, str], list[str]] | None = None
        self._printed_verdict: tuple[str, str] | None = None
        self._printed_at = -HEADLINE_EVERY_S
        self._gone = False

    @classmethod
    def for_stream(cls, out: TextIO) -> Screen:
        tty = out.isatty()
        return cls(out, tty=tty, color=tty and "NO_COLOR" not in os.environ)

    @property
    def width(self) -> int:
        """Columns of the terminal; 0 (no limit) without one."""
        return shutil.get_terminal_size().columns if self.tty else 0

    def _write(self, text: str) -> None:
        """One write per update: erase the live table, print `text`, draw the table again.

        The table's lines never wrap (they are cut to the width and height of the
        terminal), so moving the cursor up by their count lands on the table's first line.
        """
        erase = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        frame = "".join(line + "\n" for line in self._frame)
        self._emit(erase + text + frame)
        self._drawn = len(self._frame)

    def _emit(self, text: str) -> None:
        """Write and flush; a reader that went away (`imexd demo | head`) must not stop
        the cleanup, so output simply ends there."""
        if self._gone:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (BrokenPipeError, ValueError):
            self._gone = True

    def say(self, text: str = "") -> None:
        """Lines that stay: the header, events, the summary (wrapped between words on a
        terminal)."""
        if self.tty:
            width = self.width
            self._write("".join(line + "\n" for line in wrap_event(text, width)))
        else:
            self._emit(text + "\n")

    def frame(
        self, head: str, lines: list[str], *, verdict: tuple[str, str], force: bool = False
    ) -> None:
        """The headline `head` and the table `lines` below it. `verdict` is the domain's
        state and reason (the headline less its clock); `force`: a milestone of the story,
        where the table is printed without a terminal if it changed."""
        if self.tty:
            rows = shutil.get_terminal_size().lines - 1
            lines = [head, *lines]
            if len(lines) > rows > 2:
                lines = [*lines[: rows - 1], f"... {len(lines) - rows + 1} more lines"]
            self._frame = lines
            self._write("")
            return
        now = self.clock()
        if force:
            plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines]
            if self._printed_table != (verdict, plain):
                self._printed_table = (verdict, plain)
                said = verdict == self._printed_verdict  # its headline is on screen already
                self._printed_verdict, self._printed_at = verdict, now
                self._emit("\n".join(lines if said else [head, *lines]) + "\n\n")
            return
        if verdict != self._printed_verdict and now - self._printed_at >= HEADLINE_EVERY_S:
            self._printed_verdict, self._printed_at = verdict, now
            self._emit(head + "\n")

    def close(self) -> None:
        """Keep the last table on a terminal; the summary goes below it."""
        self._frame, self._drawn = [], 0
        self._emit("")
