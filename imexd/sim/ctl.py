"""`imexd-sim-ctl`: a stand-in for `nvidia-imex-ctl`, with its flags, words and formats.

`-q` asks the local daemon for its state word. `-N` asks the local daemon for its node
list and its own row of the matrix, resolves the entries exactly as the daemon does
(IMEXD_SIM_HOSTS_FILE or the system resolver) and asks every peer's command service
for its row, as the real tool does; an unreachable peer is UNAVAILABLE with a row of
`I`. `-n` repeats `-N` every second until interrupted. Exit codes: 0 when the local
daemon answered (whatever the domain state), 1 on any failure.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from imexd.sim.cfgfile import DEFAULT_CONFIG_PATH, USAGE, ImexConfigError
from imexd.sim.command import (
    QUERY_FRAME,
    QUERY_REPLIES,
    CmdTarget,
    CommandError,
    NodeState,
    decode_status,
    exchange,
    target_from_config,
)

TYPE_CHECKING = False  # typing's own flag costs `-q` the import of typing
if TYPE_CHECKING:
    from imexd.sim.command import NodeStatus
    from imexd.sim.table import DomainView

DEFAULT_TIMEOUT_MS = 5000
MONITOR_INTERVAL_S = 1.0


class UsageError(Exception):
    """The command line is wrong; the message (if any) is printed before the usage."""


class CtlArgs:
    """The parsed command line (a plain class: `-q` imports no dataclasses)."""

    __slots__ = ("config", "host_names", "json", "mode", "target", "timeout_s")

    def __init__(
        self,
        *,
        mode: str,
        config: str = DEFAULT_CONFIG_PATH,
        target: CmdTarget | None = None,
        json: bool = False,
        host_names: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_MS / 1000,
    ) -> None:
        self.mode = mode
        """One of q, N, n (and s, d, m, which the simulator does not model)."""
        self.config = config
        self.target = target
        """From -i or -u; None = from the command service keys of `config`."""
        self.json = json
        self.host_names = host_names
        self.timeout_s = timeout_s


def parse_args(argv: Sequence[str]) -> CtlArgs | None:
    """The real tool's flags; None for -h. Hand-written to print the real usage line."""
    args = list(argv)
    mode: str | None = None
    config = DEFAULT_CONFIG_PATH
    target: CmdTarget | None = None
    as_json = host_names = False
    timeout_ms = DEFAULT_TIMEOUT_MS

    def value(count: int = 1) -> list[str]:
        if len(args) < count:
            raise UsageError(f"Option {flag} needs {count} argument(s)")
        taken = args[:count]
        del args[:count]
        return taken

    while args:
        flag = args.pop(0)
        if flag in ("-h", "--help"):
            return None
        if flag in ("-q", "-N", "-n", "-s", "-d", "-m"):
            if mode is not None and mode != flag[1]:
                raise UsageError("Only one of -n, -N, -q, -s, -d, -m may be given")
            mode = flag[1]
        elif flag == "-c":
            (config,) = value()
        elif flag == "-i":
            host, port = value(2)
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise UsageError(f"Invalid port {port}")
            target = CmdTarget(host=host, port=int(port))
        elif flag == "-u":
            (path,) = value()
            target = CmdTarget(path=path)
        elif flag == "-t":
            (text,) = value()
            if not text.isdigit() or int(text) == 0:
                raise UsageError(f"Invalid timeout {text}: expected milliseconds > 0")
            timeout_ms = int(text)
        elif flag == "-j":
            as_json = True
        elif flag == "-H":
            host_names = True
        else:
            raise UsageError(f"Unknown option {flag}")
    if mode is None:
        raise UsageError("")
    return CtlArgs(
        mode=mode,
        config=config,
        target=target,
        json=as_json,
        host_names=host_names,
        timeout_s=timeout_ms / 1000,
    )


def query(target: CmdTarget, *, timeout_s: float) -> NodeState:
    """`-q`: the daemon's state word. A reply other than the daemon's own bytes for a
    state goes through the protocol's strict decoder, which says what is wrong with it."""
    line = exchange(target, QUERY_FRAME, timeout_s=timeout_s)
    if (state := QUERY_REPLIES.get(line)) is not None:
        return state
    from imexd.sim.protocol import QueryReply, decode_reply  # noqa: PLC0415 - lazy: an odd reply only

    reply = decode_reply(target, line)
    if not isinstance(reply, QueryReply):
        raise CommandError(f"{target} answered a query with {type(reply).__name__}")
    return reply.state


def domain_view(target: CmdTarget, timeout_s: float, hosts_file: str | None) -> DomainView:
    """`-N`: the local node's answer, then every peer's, asked all at once (blocking
    sockets under one poll, replies read with the standard json module: the agent runs
    this after every start and at the daemon's news of a link, and an event loop's or
    msgspec's import would cost more than the questions)."""
    # Lazy: `-q` needs none of these.
    from imexd.sim.command import STATUS_FRAME, exchange_all  # noqa: PLC0415
    from imexd.sim.hosts import Resolver, dialable  # noqa: PLC0415
    from imexd.sim.table import build_view  # noqa: PLC0415

    local = decode_status(target, exchange(target, STATUS_FRAME, timeout_s=timeout_s))
    addresses = Resolver(hosts_file).resolve_blocking(local.nodes)
    asked = {
        j: CmdTarget(host=address, port=local.cmd_port)
        for j, address in enumerate(addresses)
        if j != local.node and address is not None and dialable(address)
    }
    answers = exchange_all(list(asked.values()), STATUS_FRAME, timeout_s=timeout_s)
    peers: dict[int, NodeStatus | None] = dict.fromkeys(range(len(local.nodes)))
    for (j, peer), answer in zip(asked.items(), answers, strict=True):
        if not isinstance(answer, CommandError):
            peers[j] = _readable(peer, answer)
    peers.pop(local.node, None)  # a node id beyond its own list: no row is its own
    return build_view(local=local, addresses=addresses, peers=peers, at=time.time())


def _readable(peer: CmdTarget, answer: bytes) -> NodeStatus | None:
    """A peer's status reply; None (UNAVAILABLE, a row of I) when it is unreadable."""
    try:
        return decode_status(peer, answer)
    except CommandError:
        return None


def _render(view: DomainView, args: CtlArgs) -> str:
    from imexd.sim.table import render_json, render_text  # noqa: PLC0415 - see domain_view

    return render_json(view) if args.json else render_text(view, host_names=args.host_names)


def run(args: CtlArgs, target: CmdTarget, hosts_file: str | None) -> int:
    """Carry out one invocation; returns the exit code."""
    if args.mode == "q":
        return run_query(args, target)
    if args.mode == "N":
        try:
            view = domain_view(target, args.timeout_s, hosts_file)
        except CommandError as exc:
            return unavailable(args, exc)
        sys.stdout.write(_render(view, args))
        return 0
    if args.mode == "n":
        return monitor(args, target, hosts_file)
    print(f"Option -{args.mode} is not modelled by the IMEX simulator", file=sys.stderr)
    return 1


def run_query(args: CtlArgs, target: CmdTarget) -> int:
    """`-q`: print the state word; exit 1 (printing UNAVAILABLE) when nobody answers."""
    try:
        state = query(target, timeout_s=args.timeout_s)
    except CommandError as exc:
        return unavailable(args, exc)
    print(state)
    return 0


def unavailable(args: CtlArgs, exc: CommandError) -> int:
    """The local daemon did not answer: `-q` still prints its word; exit 1."""
    if args.mode == "q":
        print(NodeState.UNAVAILABLE)
    print(f"Unable to query the IMEX daemon: {exc}", file=sys.stderr)
    return 1


def monitor(args: CtlArgs, target: CmdTarget, hosts_file: str | None) -> int:
    """`-n`: `-N` once a second until SIGINT or SIGTERM; each round bounded by -t."""
    import signal  # noqa: PLC0415 - lazy: only the monitor waits between rounds
    import threading  # noqa: PLC0415

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        try:
            view = domain_view(target, args.timeout_s, hosts_file)
        except CommandError as exc:
            print(f"Unable to query the IMEX daemon: {exc}", file=sys.stderr)
        else:
            sys.stdout.write(_render(view, args) + ("" if args.json else "\n"))
            sys.stdout.flush()
        stop.wait(MONITOR_INTERVAL_S)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`imexd-sim-ctl [-c CONFIG | -i IP PORT | -u PATH] (-q | -N [-j] [-H] | -n) [-t MS]`."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        if str(exc):
            print(exc, file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 1
    if args is None:
        print(USAGE)
        return 0
    target = args.target
    if target is None:
        try:
            target = target_from_config(args.config)
        except ImexConfigError as exc:
            print(exc, file=sys.stderr)
            print(USAGE, file=sys.stderr)
            return 1
        except CommandError as exc:
            return unavailable(args, exc)
    if args.mode == "q":
        return run_query(args, target)
    from imexd.sim.hosts import hosts_file_from_environ  # noqa: PLC0415 - lazy: `-q` returned above

    hosts_file = hosts_file_from_environ()
    try:
        return run(args, target, hosts_file)
    except KeyboardInterrupt:  # pragma: no cover - only outside monitor mode
        return 1


if __name__ == "__main__":
    sys.exit(main())
