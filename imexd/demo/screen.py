"""What the demo shows: the table of nodes, its colours, and the terminal it is drawn on.

Pure rendering of what the scenario knows (each agent's HealthReport, how its processes
are), laid out by `imexd.health.fleet.table` like every table imexd prints; only the
colours and the redrawing in place belong to the demo.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import textwrap
import time
from collections.abc import Sequence
from typing import Final, TextIO

from imexd.health.fleet import table
from imexd.messages import HealthReport, failing

SNAPSHOT_EVERY_S: Final = 1.0
"""Without a terminal a changed table is printed at most this often."""


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One node's line of the table: what its agent reports and how its processes are."""

    node: str
    address: str
    agent: str
    """starting, up, down (killed by the demo), leaving, left, exited."""
    report: HealthReport | None
    """Its agent's last `/status`; None while the agent does not answer."""
    orphan_pid: int | None = None
    """The daemon's pid while its agent is down and the daemon runs on alone."""


HEADER: Final = ("SLOT", "NODE", "ADDRESS", "AGENT", "DAEMON", "PID", "IMEX", "READY", "SEES")
GREEN: Final = frozenset({"UP", "READY", "RUNNING", "up", "yes"})
YELLOW: Final = frozenset(
    {"FORMING", "STARTING", "STOPPING", "INITIALIZING", "STARTING_AUTH_SERVER", "INIT_GPU"}
    | {"WAITING_FOR_PEERS", "WAITING_FOR_RECOVERY", "starting", "leaving", "left", "STOPPED"}
    | {"LEAVING", "UNKNOWN"}
)
RED: Final = frozenset({"DEGRADED", "DOWN", "BACKOFF", "FATAL", "UNAVAILABLE", "down", "exited"})
NOTE_MAX: Final = 60
PAINTED: Final = range(3, len(HEADER))
"""The columns whose words are coloured: AGENT to SEES (not the names, not the note)."""


def _cells(row: Row) -> list[str]:
    r = row.report
    if r is None:
        daemon = "running alone" if row.orphan_pid else "-"
        pid = str(row.orphan_pid) if row.orphan_pid else "-"
        return ["-", row.node, row.address, row.agent, daemon, pid, "-", "-", "-"]
    return [
        "-" if r.slot is None else str(r.slot),
        row.node,
        row.address,
        row.agent,
        r.daemon.state or "-",
        "-" if r.daemon.pid is None else str(r.daemon.pid),
        r.daemon.imex_status or "-",
        "yes" if r.ready else "no",
        (r.domain_view.status if r.domain_view is not None else "") or "-",
    ]


def _note(row: Row) -> str:
    r = row.report
    if r is None:
        return "IMEX keeps running without its agent" if row.orphan_pid else ""
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


def _painted(line: str, starts: Sequence[int]) -> str:
    """A laid-out row with the words of the PAINTED columns coloured; `starts` are the
    columns' offsets (the header's words)."""
    out = line[: starts[PAINTED.start]]
    for column in PAINTED:
        cell = line[starts[column] : starts[column + 1]]
        word = cell.rstrip()
        out += paint(word, word, color=True) + cell[len(word) :]
    return out + line[starts[PAINTED.stop] :]


NOTE_INDENT: Final = " " * 6
"""Where a note put below its row starts (under NODE)."""


def table_lines(rows: Sequence[Row], *, color: bool = False, width: int = 0) -> list[str]:
    """The table, one string per line; `width` > 0 fits a terminal: when the notes do
    not fit beside their rows, each goes below its row, wrapped between words; what
    still does not fit is cut."""
    header = [*HEADER, "NOTE"]
    notes = [_note(r) for r in rows]
    plain = table(header, [[*_cells(r), note] for r, note in zip(rows, notes, strict=True)])
    starts: list[int] = []
    for word in header:
        starts.append(plain[0].index(word, starts[-1] if starts else 0))
    below = width > 0 and any(len(line) > width for line in plain) and starts[-1] <= width
    lines = []
    for index, line in enumerate(plain):
        if below:
            line = line[: starts[-1]].rstrip()  # noqa: PLW2901 - the row less its note
        if width and len(line) > width:
            lines.append(line[: width - 1] + "…")
        elif color and index > 0:
            lines.append(_painted(line, starts))
        else:
            lines.append(line)
        if below and index > 0 and notes[index - 1]:
            lines += textwrap.wrap(
                notes[index - 1],
                width,
                initial_indent=NOTE_INDENT,
                subsequent_indent=NOTE_INDENT,
            )
    return lines


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
    """Events scroll, the table stays below them and is redrawn in place on a terminal;
    elsewhere (a pipe, a CI log) each changed table is appended, at most once a second."""

    def __init__(self, out: TextIO, *, tty: bool, color: bool) -> None:
        self.out = out
        self.tty = tty
        self.color = color
        self._frame: list[str] = []
        self._drawn = 0
        self._last_key: list[str] | None = None
        self._last_print = 0.0
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

    def frame(self, key: list[str], lines: list[str], *, force: bool = False) -> None:
        """The live table; `key` is what counts as a change (the lines less the clock)."""
        if self.tty:
            rows = shutil.get_terminal_size().lines - 1
            if len(lines) > rows > 2:
                lines = [*lines[: rows - 1], f"... {len(lines) - rows + 1} more lines"]
            self._frame = lines
            self._write("")
            return
        now = time.monotonic()
        changed = key != self._last_key
        if changed and (force or now - self._last_print >= SNAPSHOT_EVERY_S):
            self._last_key, self._last_print = key, now
            self._emit("\n".join(lines) + "\n\n")

    def close(self) -> None:
        """Keep the last table on a terminal; the summary goes below it."""
        self._frame, self._drawn = [], 0
        self._emit("")
