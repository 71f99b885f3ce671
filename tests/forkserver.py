"""Agent processes forked from one that has already imported the agent.

An `imexd run` process spends most of its start importing (asyncio, paho, msgspec,
structlog, the agent itself): about 0.3 CPU-s, paid again for every agent a scenario
starts and restarts, several hundred times a suite run on two cores. The fork server
imports the agent once, as `imexd run` does (`imexd.cli.main._run_agent`), and forks one
child per agent that runs `imexd.cli.main.main(["run", "--config", ...])`: a process of
its own, in a session of its own, with its own environment, log file and pid, which
signals, `/proc` and the broker see as they would see the console script's; only its
command line is the server's. `ForkedAgent` gives the test the `subprocess.Popen` calls
tests/cluster.py makes (`poll`, `wait`, `send_signal`, `kill`, `pid`).

What stays with real `imexd` processes: tests that start the console script themselves
(tests/test_cli.py, the README tour, systemd, Slurm), agents run through a prefix (`ip
netns exec`), and the benchmarks (bench/ starts its agents through tests/cluster.py
without this module's switch, since they time the whole start).

The server runs no thread and no event loop before a fork, and each child seeds its own
`random`. It writes one JSON line per spawned child (`{"pid": N}`) and per child that
ended (`{"ended": N, "code": C}`, C as `Popen.returncode`: minus the signal that killed
it); a reader thread of the test process turns those into exit codes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final

SPAWN_TIMEOUT_S: Final = 10.0
REAP_S: Final = 0.05
"""How often the server looks for children that ended while no request comes."""


def _serve() -> int:
    """The server: import the agent, then fork one child per request line on stdin."""
    sys.modules.setdefault("rich", None)  # type: ignore[arg-type] # as `imexd run` does
    from imexd.cli.deferred import defer_unused_imports

    defer_unused_imports()
    # What `imexd run` imports, loaded once here for every child.
    import imexd.agent.run
    import imexd.cli.main
    import imexd.logs
    import imexd.preflight
    import imexd.settings

    requests = sys.stdin.buffer
    replies = sys.stdout
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], REAP_S)
        if ready:
            chunk = os.read(requests.fileno(), 65536)
            if not chunk:
                return 0  # the test process is gone: its children are its cleanup's
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = _fork(json.loads(line), imexd.cli.main.main)
                replies.write(json.dumps({"pid": pid}) + "\n")
                replies.flush()
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            replies.write(json.dumps({"ended": pid, "code": code}) + "\n")
            replies.flush()


def _fork(request: Mapping[str, Any], main: Any) -> int:
    """Fork the child of `request` ({"argv", "env", "log"}); its pid, in the parent."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 65536)
        os.environ.clear()
        os.environ.update(request["env"])
        import random

        random.seed()  # the child's own sequence, not the server's
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
        sys.argv = ["imexd", *request["argv"]]
        try:
            code = main(request["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class ForkServer:
    """One server per test process, started at its first spawn."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True,
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._spawned: list[int] = []
        self._ended: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="forkserver", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def spawn(self, argv: list[str], env: Mapping[str, str], log: Path) -> ForkedAgent:
        """A child running `imexd ARGV` with exactly `env`, stdout and stderr on `log`."""
        request = json.dumps({"argv": argv, "env": dict(env), "log": str(log)}) + "\n"
        with self._lock:
            with self._changed:
                before = len(self._spawned)
            stdin = self._proc.stdin
            assert stdin is not None
            stdin.write(request.encode())
            stdin.flush()
            with self._changed:
                got = self._changed.wait_for(
                    lambda: len(self._spawned) > before or not self.alive(), SPAWN_TIMEOUT_S
                )
                assert got, "the fork server did not answer"
                assert len(self._spawned) > before, "the fork server ended"
                pid = self._spawned[before]
        return ForkedAgent(self, pid)

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._ended.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: pid in self._ended, timeout):
                raise subprocess.TimeoutExpired(f"agent pid {pid}", timeout or 0.0)
            return self._ended[pid]

    def _read(self) -> None:
        out: IO[bytes] | None = self._proc.stdout
        assert out is not None
        for line in out:
            said = json.loads(line)
            with self._changed:
                if "pid" in said:
                    self._spawned.append(said["pid"])
                else:
                    self._ended[said["ended"]] = said["code"]
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """End the server (its children stay: each test ends its own agents)."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)


class ForkedAgent:
    """The `subprocess.Popen` calls tests/cluster.py makes, for a child of the server."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.args = ["imexd", "run"]

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid)

    def poll(self) -> int | None:
        return self._server.returncode(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        return self._server.wait(self.pid, timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server() -> ForkServer:
    """This process's fork server (started again if it died)."""
    global _server  # noqa: PLW0603 - one per test process
    with _server_lock:
        if _server is None or not _server.alive():
            _server = ForkServer()
        return _server


def close() -> None:
    """End this process's fork server, if one runs."""
    global _server  # noqa: PLW0603
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


if __name__ == "__main__":
    sys.exit(_serve())
