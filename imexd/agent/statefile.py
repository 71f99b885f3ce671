"""The state files: what the agent remembers across restarts, read once and saved on change.

A restarted agent reads state.json to claim its previous slot again (slots are sticky, so
the IMEX node ids of its peers do not move) and to publish a higher incarnation than any
record it left on the bus. The file is small JSON, written atomically; the record itself
(`imexd.nodestate.NodeState`) is pure, so the shard that decides what to save imports no I/O.
records.json holds the newest control-plane records the agent followed (`RecordFile`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import msgspec

from imexd.errors import FileWriteError
from imexd.files import write_atomic
from imexd.health.metrics import Metrics
from imexd.logs import get_logger
from imexd.nodestate import NodeState

STATE_FILE = "state.json"

log = get_logger("state")


class _Stored(msgspec.Struct, kw_only=True):
    domain: str | None = None
    clique: str = ""
    slot: int | None = None
    incarnation: int = 0


class StateStore:
    """Loads the state once, bumps the incarnation, and saves changes atomically."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / STATE_FILE
        self.current = NodeState()

    def load_and_bump(self) -> NodeState:
        """Read the previous state (a missing or damaged file counts as empty) and
        start a new incarnation, saved before anything is published with it."""
        previous = NodeState()
        try:
            stored = msgspec.json.decode(self.path.read_bytes(), type=_Stored)
            previous = NodeState(
                domain=stored.domain,
                clique=stored.clique,
                slot=stored.slot,
                incarnation=max(0, stored.incarnation),
            )
        except FileNotFoundError:
            pass
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("state.unreadable", path=str(self.path), error=str(exc))
        self.current = replace(previous, incarnation=previous.incarnation + 1)
        self.save(self.current)
        return self.current

    def save(self, state: NodeState) -> None:
        """Persist `state`; raises FileWriteError (the caller retries)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FileWriteError(str(self.path.parent), exc.strerror or str(exc)) from exc
        data = msgspec.json.encode(
            _Stored(
                domain=state.domain,
                clique=state.clique,
                slot=state.slot,
                incarnation=state.incarnation,
            )
        )
        write_atomic(self.path, data + b"\n", mode=0o644)
        self.current = state

    def keep(self, state: NodeState, *, metrics: Metrics) -> None:
        """`save`, counted in `metrics`; a failure is logged, and the agent goes on."""
        try:
            self.save(state)
        except FileWriteError as exc:
            log.error("state.unwritable", error=str(exc))
        metrics.count_write("state", ok=self.current == state)


RECORDS_FILE = "records.json"


class _Records(msgspec.Struct, kw_only=True):
    records: dict[str, str] = msgspec.field(default_factory=dict)
    """Topic -> the record's bytes as they came (UTF-8 JSON, signature included)."""


class RecordFile:
    """The control-plane records the agent follows, newest only (`imexd.order`), kept
    across restarts so that a restarted agent still answers an older copy with the newer
    one it saw, and still holds the deletions it saw."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / RECORDS_FILE

    def load(self) -> dict[str, bytes]:
        """Topic -> bytes; a missing or damaged file holds nothing."""
        try:
            stored = msgspec.json.decode(self.path.read_bytes(), type=_Records)
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("state.unreadable", path=str(self.path), error=str(exc))
            return {}
        return {topic: data.encode() for topic, data in stored.records.items()}

    def save(self, records: dict[str, bytes]) -> None:
        """Persist `records`; raises FileWriteError (the caller tries again later)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FileWriteError(str(self.path.parent), exc.strerror or str(exc)) from exc
        text = {topic: data.decode("utf-8", "replace") for topic, data in sorted(records.items())}
        write_atomic(self.path, msgspec.json.encode(_Records(records=text)) + b"\n", mode=0o600)
