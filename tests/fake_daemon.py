"""A scriptable stand-in for `nvidia-imex`, for the supervisor's tests.

Installed by the tests as an executable named `nvidia-imex` (shebang = this Python), so
that process scans recognise it like the real daemon. It takes `-c CONFIG` and reads its
behaviour from the environment:

- FAKE_IMEX_FAIL_IF_EXISTS=PATH: when PATH exists, print an error and exit at once
- FAKE_IMEX_EXIT_AFTER_S=S, FAKE_IMEX_EXIT_CODE=N: exit with N after S seconds
- FAKE_IMEX_EXIT_ONCE=PATH: with EXIT_AFTER_S, exit only if PATH does not exist (and
  create it), so the next run lives
- FAKE_IMEX_IGNORE_TERM=1: ignore SIGTERM (only SIGKILL ends it)
- FAKE_IMEX_CHILD=1: start a child in its process group that ignores SIGTERM
- FAKE_IMEX_PIDFILE=PATH: write "<pid> [<child pid>]" there once started
- FAKE_IMEX_LOG_EVERY_S=S: write a log line to stderr every S seconds
- FAKE_IMEX_READY_AFTER_S=S: after S seconds, log the simulator's line saying that the
  daemon's state changed to READY
- FAKE_IMEX_MAX_LIFE_S=S: exit after S seconds whatever happens (default 60: a crashed
  test leaves nothing behind for long)

Like a C daemon, it dies of SIGPIPE when its output pipe has no reader any more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType


def log(level: str, message: str) -> None:
    stamp = time.strftime("%b %d %Y %H:%M:%S")
    sys.stderr.write(f"[{stamp}] [{level}] [tid {os.getpid()}] {message}\n")
    sys.stderr.flush()


def main() -> int:
    args = sys.argv[1:]
    if "-c" not in args:
        sys.stderr.write("usage: nvidia-imex -c CONFIG\n")
        return 2
    config = args[args.index("-c") + 1]
    env = os.environ
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    print("IMEX Log initializing at: " + time.strftime("%m/%d/%Y %H:%M:%S"), flush=True)
    fail_if = env.get("FAKE_IMEX_FAIL_IF_EXISTS", "")
    if fail_if and os.path.exists(fail_if):
        log("ERROR", f"Failed to read node configuration file for {config}")
        sys.stderr.write("fatal: no usable node configuration\n")
        sys.stderr.flush()
        return int(env.get("FAKE_IMEX_EXIT_CODE", "3"))
    log("INFO", f"IMEX version 570.148.08 is running with configuration {config}")

    def on_term(signum: int, frame: FrameType | None) -> None:
        log("INFO", "Shutting down")
        sys.exit(0)

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        log("INFO", "SIGUSR1: reconnecting")

    if env.get("FAKE_IMEX_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_usr1)

    pids = [str(os.getpid())]
    if env.get("FAKE_IMEX_CHILD") == "1":
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(60)",
            ],
            stdin=subprocess.DEVNULL,
        )
        pids.append(str(child.pid))
    pidfile = env.get("FAKE_IMEX_PIDFILE", "")
    if pidfile:
        with open(pidfile + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(" ".join(pids) + "\n")
        os.replace(pidfile + ".tmp", pidfile)

    started = time.monotonic()
    exit_after = float(env.get("FAKE_IMEX_EXIT_AFTER_S", "0") or 0)
    once = env.get("FAKE_IMEX_EXIT_ONCE", "")
    if exit_after and once:
        if os.path.exists(once):
            exit_after = 0.0
        else:
            with open(once, "w", encoding="utf-8"):
                pass
    every = float(env.get("FAKE_IMEX_LOG_EVERY_S", "0") or 0)
    ready_after = env.get("FAKE_IMEX_READY_AFTER_S", "")
    ready_at = started + float(ready_after) if ready_after else None
    max_life = float(env.get("FAKE_IMEX_MAX_LIFE_S", "60"))
    last_log = started
    while True:
        now = time.monotonic()
        if exit_after and now - started >= exit_after:
            log("ERROR", "Lost the GPU, exiting")
            return int(env.get("FAKE_IMEX_EXIT_CODE", "3"))
        if now - started >= max_life:
            return 0
        if ready_at is not None and now >= ready_at:
            log("INFO", "IMEX daemon state changed from INIT_GPU to READY")
            ready_at = None
        if every and now - last_log >= every:
            log("INFO", "heartbeat")
            last_log = now
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
