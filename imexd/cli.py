"""The `imexd` command line: argument parsing and dispatch, nothing else.

Each subcommand is a function `(args) -> exit code` in the module that owns the
concern, imported only when that subcommand runs (the simulator and the control plane
do not pay for the agent's imports). Exit codes: 0 success, 1 failure or not ready,
2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Protocol

from imexd import __version__
from imexd.errors import ConfigError, ImexdError
from imexd.messages import MAX_CHANNEL
from imexd.names import (
    domain_problem,
    max_nodes_problem,
    node_problem,
    parse_nodes,
)
from imexd.settings import DEFAULT_CONFIG_PATH, parse_broker_url

MAX_ID: Final = 4294967294
"""The largest uid or gid a channel device may be given (-1 means "unchanged" to chown)."""


class _Command(Protocol):
    def __call__(self, args: argparse.Namespace) -> int: ...


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        default=None,
        help=f"settings file (TOML); default {DEFAULT_CONFIG_PATH}, absent = defaults",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imexd", description="Node-local supervisor for the NVIDIA IMEX daemon."
    )
    parser.add_argument("--version", action="version", version=f"imexd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the agent (systemd service, container)")
    _config_arg(p)
    p.set_defaults(handler=_cmd_run)

    p = sub.add_parser("config", help="validate settings and print the effective values")
    _config_arg(p)
    p.add_argument(
        "--example", action="store_true", help="print the commented example file instead"
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="print the settings reference table of docs/configuration.md (for developers)",
    )
    p.set_defaults(handler=_cmd_config)

    p = sub.add_parser("render", help="dry run: print the files the agent would write")
    _config_arg(p)
    p.add_argument("--members", required=True, help="JSON file: a list of MemberRecords")
    p.add_argument("--out", default=None, help="write the files into this folder instead")
    p.set_defaults(handler=_cmd_render)

    p = sub.add_parser("discover", help="discover the GPU fabric clique through NVML")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds for the NVML child")
    p.set_defaults(handler=_cmd_discover)

    p = sub.add_parser("check", help="exec probe: exit 0 when the local agent is ready")
    _config_arg(p)
    p.add_argument("--url", default=None, help="agent base URL, e.g. http://127.0.0.1:9440")
    p.add_argument("--live", action="store_true", help="check /healthz instead of /readyz")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.set_defaults(handler=_cmd_check)

    p = sub.add_parser("status", help="the local agent's state, for a person")
    _config_arg(p)
    p.add_argument("--url", default=None, help="agent base URL, e.g. http://127.0.0.1:9440")
    p.add_argument("--json", action="store_true", help="print the HealthReport JSON")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser("domain", help="control plane: create, delete, list, status")
    dsub = p.add_subparsers(dest="domain_command", required=True, metavar="ACTION")
    q = dsub.add_parser("create", help="publish a DomainSpec (and assignments)")
    _config_arg(q)
    q.add_argument("name")
    q.add_argument("--nodes", default=None, help="comma-separated node names, in slot order")
    q.add_argument("--max-nodes", type=int, default=None, help="slots per clique")
    q.add_argument(
        "--steal",
        action="store_true",
        help="take listed nodes out of another live domain (stops their daemons there)",
    )
    q.add_argument(
        "--channel",
        type=integer,
        nargs="?",
        const=0,
        default=None,
        metavar="N",
        help="also create workload NAME in this domain on IMEX channel N (no value: 0), "
        "for one domain per job; default: no workload",
    )
    _owner_args(q, "with --channel: ")
    q.set_defaults(handler=_cmd_domain_create)
    q = dsub.add_parser(
        "delete", help="delete a domain: agents stop their daemons; its workloads are cleared"
    )
    _config_arg(q)
    q.add_argument("name")
    q.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for agents")
    q.set_defaults(handler=_cmd_domain_delete)
    q = dsub.add_parser("list", help="list domains with a spec or members")
    _config_arg(q)
    q.set_defaults(handler=_cmd_domain_list)
    q = dsub.add_parser("status", help="one table from the members' HealthReports")
    _config_arg(q)
    q.add_argument("name")
    q.add_argument("--json", action="store_true")
    q.add_argument("--watch", action="store_true", help="redraw on every change")
    q.add_argument("--wait", type=float, default=2.0, help="seconds to collect reports")
    q.add_argument(
        "--nodes",
        default=None,
        help="comma-separated nodes the domain must have (default: the spec's list)",
    )
    q.set_defaults(handler=_cmd_domain_status)

    _workload_parser(sub)

    p = sub.add_parser("node", help="control plane: assign nodes to domains")
    nsub = p.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    q = nsub.add_parser("assign", help="assign NODE to DOMAIN")
    _config_arg(q)
    q.add_argument("node")
    q.add_argument("domain")
    q.add_argument(
        "--steal",
        action="store_true",
        help="move the node out of another live domain (stops its daemon there)",
    )
    q.add_argument(
        "--force", action="store_true", help="assign a node that no agent reported lately"
    )
    q.add_argument(
        "--seen-within",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how recent the node's agent must have reported (default 600)",
    )
    q.set_defaults(handler=_cmd_node_assign)
    q = nsub.add_parser("unassign", help="take NODE out of its domain")
    _config_arg(q)
    q.add_argument("node")
    q.set_defaults(handler=_cmd_node_unassign)

    p = sub.add_parser(
        "schemas",
        help="for developers: write or check the bus payloads' JSON Schemas (docs/schemas)",
    )
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="DIR", help="write the schemas into DIR")
    action.add_argument("--check", metavar="DIR", help="exit 1 if DIR's schemas differ")
    p.set_defaults(handler=_cmd_schemas)

    p = sub.add_parser("demo", help="form a domain of simulated nodes on this machine")
    p.add_argument("--nodes", type=int, default=4, help="how many simulated nodes")
    p.add_argument("--broker", default=None, help="use this broker instead of an embedded one")
    p.set_defaults(handler=_cmd_demo)
    return parser


def integer(text: str) -> int:
    """An integer option (argparse reports a ValueError as a usage error naming it)."""
    return int(text, 10)


def _mode_arg(text: str) -> int:
    """`--mode`: octal permission bits such as 0660, 660 or 0o660."""
    digits = text.removeprefix("0o")
    if not digits or any(c not in "01234567" for c in digits):
        raise argparse.ArgumentTypeError(f"{text!r}: expected octal permission bits such as 0660")
    mode = int(digits, 8)
    if mode > 0o777:
        raise argparse.ArgumentTypeError(f"{text!r}: expected permission bits 0000 to 0777")
    return mode


def _owner_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """--uid, --gid and --mode: the owner and mode of the channel's device node."""
    parser.add_argument(
        "--uid",
        type=integer,
        default=None,
        help=f"{prefix}owner user id of the channel device (default 0)",
    )
    parser.add_argument(
        "--gid",
        type=integer,
        default=None,
        help=f"{prefix}owner group id of the channel device (default 0)",
    )
    parser.add_argument(
        "--mode",
        type=_mode_arg,
        default=None,
        help=f"{prefix}permission bits of the channel device, octal (default 0660)",
    )


def _domain_arg(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    if required:
        parser.add_argument("--domain", required=True, help="the workload's domain (required)")
    else:
        parser.add_argument(
            "--domain",
            default=None,
            help="the workload's domain (default: the one domain that has a workload NAME)",
        )


WORKLOAD_EXITS: Final = {
    "create": "exit codes: 0 ready on every listed node (or written, with --wait 0); 1 not "
    "ready by the deadline (the record is kept), a lost race retried too often, or a bus "
    "error; 2 usage error (bad name or mode, --channel used by another workload of the "
    "domain, the workload exists on another channel); 3 no free channel",
    "delete": "exit codes: 0 deleted and no node lists it any more; 1 no such workload, "
    "nodes still list it at the deadline, or a bus error; 2 usage error",
    "list": "exit codes: 0 listed; 1 bus error; 2 usage error",
    "status": "exit codes: 0 every listed node has the channel ready; 1 not ready, no such "
    "workload, or a bus error; 2 usage error (also: NAME in several domains and no --domain)",
    "env": "exit codes: 0 printed; 1 no such workload, or not active; 2 usage error",
}


def _workload_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`imexd workload create|delete|list|status|env`: IMEX channels for named workloads."""
    p = sub.add_parser(
        "workload", help="control plane: IMEX channels for workloads (create, delete, ...)"
    )
    wsub = p.add_subparsers(dest="workload_command", required=True, metavar="ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        q = wsub.add_parser(
            name, help=help_text, description=f"{help_text}. {WORKLOAD_EXITS[name]}."
        )
        _config_arg(q)
        return q

    q = action("create", "create or update a workload: a channel on its domain's nodes")
    q.add_argument("name", help="the workload's name (DNS-1123 label)")
    _domain_arg(q, required=True)
    q.add_argument(
        "--nodes",
        default=None,
        help="comma-separated nodes that get the channel (default: the domain spec's node "
        "list, else every node of the domain)",
    )
    q.add_argument(
        "--channel",
        type=integer,
        default=None,
        metavar="N",
        help="this channel (0 only this way); default: the lowest free channel from 1, "
        "kept when the workload exists",
    )
    _owner_args(q)
    q.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="wait this long for every listed node to have the channel ready (default 60; "
        "0: do not wait)",
    )
    q.add_argument("--json", action="store_true", help="print the status as JSON (default: text)")
    q.set_defaults(handler=_cmd_workload_create)

    q = action("delete", "delete a workload: its nodes remove the channel")
    q.add_argument("name", help="the workload's name")
    _domain_arg(q)
    q.add_argument(
        "--wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="wait this long for the nodes to remove the channel (default 30; 0: do not wait)",
    )
    q.set_defaults(handler=_cmd_workload_delete)

    q = action("list", "list workloads: channel, state, nodes and how many are ready")
    q.add_argument("--domain", default=None, help="only this domain's (default: every domain)")
    q.add_argument("--json", action="store_true", help="print a JSON array (default: a table)")
    q.set_defaults(handler=_cmd_workload_list)

    q = action("status", "a workload's channel on each of its nodes")
    q.add_argument("name", help="the workload's name")
    _domain_arg(q)
    q.add_argument(
        "--wait",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="wait this long for every listed node to be ready (default 2; 0: do not wait)",
    )
    q.add_argument("--json", action="store_true", help="print JSON (default: a table)")
    q.set_defaults(handler=_cmd_workload_status)

    q = action("env", "print `export` lines for the workload's channel (Slurm TaskProlog)")
    q.add_argument("name", help="the workload's name")
    _domain_arg(q)
    q.set_defaults(handler=_cmd_workload_env)


def _cmd_config(args: argparse.Namespace) -> int:
    """Print the effective settings (file + environment) as TOML-like lines."""
    from imexd.settings import iter_settings, load_settings  # noqa: PLC0415
    from imexd.settings_text import example_toml, reference_markdown  # noqa: PLC0415

    if args.example:
        print(example_toml(), end="")
        return 0
    if args.reference:
        print(reference_markdown(), end="")
        return 0
    settings = load_settings(args.config)
    for info in iter_settings():
        value = getattr(getattr(settings, info.section), info.key)
        if isinstance(value, tuple):
            value = list(value)
        elif info.kind == "table":
            value = dict(value)
        print(f"{info.section}.{info.key} = {value!r}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """`imexd run`: validate the settings (exit 2 when wrong), then run the agent.

    Signals only set events: SIGTERM/SIGINT `stop` (leave: clear the record, stop the
    daemon, exit 0), SIGUSR2 `handover` and `stop` (exit 75, daemon left running).
    """
    from imexd import agent  # noqa: PLC0415 - lazy: only this command pays for it
    from imexd.logs import configure_logging, get_logger, install_loop_handler  # noqa: PLC0415
    from imexd.settings import load_settings  # noqa: PLC0415 - with the agent

    settings = load_settings(args.config)
    configure_logging(settings.log.level, settings.log.format)
    log = get_logger("agent")
    if os.geteuid() != 0:
        log.info("agent.unprivileged", uid=os.geteuid())

    async def main() -> int:
        install_loop_handler()
        stop, handover = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_stop(signame: str) -> None:
            log.info("agent.signal", signal=signame)
            stop.set()

        def on_handover() -> None:
            log.info("agent.signal", signal="SIGUSR2")
            handover.set()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_stop, sig.name)
        loop.add_signal_handler(signal.SIGUSR2, on_handover)
        try:
            return await agent.run(settings, stop=stop, handover=handover)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
                loop.remove_signal_handler(sig)

    return asyncio.run(main())


def _cmd_render(args: argparse.Namespace) -> int:
    """`imexd render`: print (or write into --out) the files the agent would write.

    Exit 0 on success, 1 when --out cannot be written, 2 for invalid settings or
    member records (one message on stderr).
    """
    from imexd import render  # noqa: PLC0415 - lazy: only this command pays for it
    from imexd.errors import FileWriteError, ParseError  # noqa: PLC0415 - with render
    from imexd.files import read_text_or_empty, write_atomic  # noqa: PLC0415 - with render
    from imexd.settings import load_settings  # noqa: PLC0415 - with render

    settings = load_settings(args.config)
    try:
        records = render.read_members(args.members)
        hosts_current = read_text_or_empty(settings.imex.hosts_file)
        targets = render.dry_run(settings, records, hosts_current=hosts_current)
    except (ParseError, ValueError) as exc:
        print(f"imexd render: {exc}", file=sys.stderr)
        return 2
    except FileWriteError as exc:
        print(f"imexd render: {exc}", file=sys.stderr)
        return 1
    if args.out is None:
        for index, (path, _, text) in enumerate(targets):
            print(("" if index == 0 else "\n") + f"==> {path} <==")
            # Undecodable bytes of a hosts file are shown as U+FFFD, written as they are.
            shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            sys.stdout.write(shown if shown.endswith("\n") or not shown else shown + "\n")
        return 0
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for _, name, text in targets:
            changed = write_atomic(out / name, text)
            print(f"{out / name}: {'written' if changed else 'unchanged'}")
    except OSError as exc:
        print(f"imexd render: cannot create {out}: {exc.strerror}", file=sys.stderr)
        return 1
    except FileWriteError as exc:
        print(f"imexd render: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_discover(args: argparse.Namespace) -> int:
    """`imexd discover`: print the fabric report and clique as JSON; exit 0, or 1 with
    the reason on stderr (the JSON, with `"clique": null`, still printed when GPUs were
    read but the rule failed, so the operator sees which GPU disagrees)."""
    import json  # noqa: PLC0415 - lazy: only this command pays for it

    from imexd import fabric  # noqa: PLC0415 - lazy: only this command pays for it
    from imexd.errors import DiscoveryError  # noqa: PLC0415 - with fabric

    timeout = float(args.timeout)
    if not timeout > 0:
        print(f"imexd discover: --timeout {args.timeout}: expected seconds > 0", file=sys.stderr)
        return 2
    try:
        doc, failure = fabric.discover_report(timeout)
    except DiscoveryError as exc:
        print(f"imexd discover: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2))
    if failure is not None:
        print(f"imexd discover: {failure}", file=sys.stderr)
        return 1
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    """`imexd check`: exit 0 when the local agent is ready (live with --live), else 1."""
    from imexd import query  # noqa: PLC0415 - lazy: only this command pays for it

    base = query.base_url(args.url, args.config)
    return query.check(base, live=bool(args.live), timeout=float(args.timeout))


def _cmd_status(args: argparse.Namespace) -> int:
    """`imexd status`: the local agent's HealthReport for a person (or --json)."""
    from imexd import query  # noqa: PLC0415 - lazy: only this command pays for it

    base = query.base_url(args.url, args.config)
    return query.status(base, as_json=bool(args.json), timeout=float(args.timeout))


def _usage(command: str, problems: Sequence[str]) -> int:
    for problem in problems:
        print(f"imexd {command}: {problem}", file=sys.stderr)
    return 2


def _owner_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with --channel, --uid and --gid (--mode is checked by argparse)."""
    problems: list[str] = []
    if args.channel is not None and not 0 <= args.channel <= MAX_CHANNEL:
        problems.append(f"--channel {args.channel}: expected 0 to {MAX_CHANNEL}")
    for option in ("uid", "gid"):
        value = getattr(args, option)
        if value is not None and not 0 <= value <= MAX_ID:
            problems.append(f"--{option} {value}: expected 0 to {MAX_ID}")
    return problems


def _cmd_domain_create(args: argparse.Namespace) -> int:
    """`imexd domain create NAME [--nodes a,b,c] [--max-nodes N] [--steal] [--channel [N]
    [--uid U] [--gid G] [--mode M]]`: with --channel, workload NAME of the domain too."""
    nodes, problems = parse_nodes(args.nodes)
    problems = [
        p for p in (domain_problem(args.name), max_nodes_problem(args.max_nodes)) if p
    ] + problems
    problems += _owner_problems(args)
    if args.channel is None:
        given = [f"--{o}" for o in ("uid", "gid", "mode") if getattr(args, o) is not None]
        if given:
            problems.append(f"{', '.join(given)} only go with --channel")
    if problems:
        return _usage("domain create", problems)
    from imexd.control import commands, workloads  # noqa: PLC0415 - lazy: only this command

    settings = commands.load_control_settings(args.config)

    async def create() -> int:
        code = await commands.create(
            settings,
            args.name,
            nodes=nodes,
            max_nodes=args.max_nodes,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
        )
        if code != 0 or args.channel is None:
            return code
        return await workloads.create(
            settings,
            args.name,
            domain=args.name,
            nodes=None,
            channel=args.channel,
            uid=args.uid,
            gid=args.gid,
            mode=args.mode,
            wait_s=0.0,
            as_json=False,
            out=sys.stdout,
            err=sys.stderr,
        )

    return asyncio.run(create())


def _cmd_domain_delete(args: argparse.Namespace) -> int:
    """`imexd domain delete NAME [--timeout S]`."""
    problems = [p for p in (domain_problem(args.name),) if p]
    if not args.timeout >= 0:
        problems.append(f"--timeout {args.timeout}: expected seconds >= 0")
    if problems:
        return _usage("domain delete", problems)
    from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

    settings = commands.load_control_settings(args.config)
    return asyncio.run(
        commands.delete(settings, args.name, wait_s=args.timeout, out=sys.stdout, err=sys.stderr)
    )


def _cmd_domain_list(args: argparse.Namespace) -> int:
    """`imexd domain list`."""
    from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

    settings = commands.load_control_settings(args.config)
    return asyncio.run(commands.list_domains(settings, out=sys.stdout))


def _cmd_domain_status(args: argparse.Namespace) -> int:
    """`imexd domain status NAME [--nodes a,b] [--json] [--watch] [--wait S]`.

    With --watch, SIGINT and SIGTERM only set the watch's stop event: it returns the exit
    status of the last state it drew.
    """
    nodes, problems = parse_nodes(args.nodes)
    problems = [p for p in (domain_problem(args.name),) if p] + problems
    if not args.wait >= 0:
        problems.append(f"--wait {args.wait}: expected seconds >= 0")
    if problems:
        return _usage("domain status", problems)
    from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

    settings = commands.load_control_settings(args.config)
    if not args.watch:
        return asyncio.run(
            commands.status(
                settings,
                args.name,
                as_json=args.json,
                wait=args.wait,
                out=sys.stdout,
                err=sys.stderr,
                nodes=nodes,
            )
        )

    async def watching() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        try:
            return await commands.watch(
                settings,
                args.name,
                as_json=args.json,
                stop=stop,
                out=sys.stdout,
                err=sys.stderr,
                nodes=nodes,
            )
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    return asyncio.run(watching())


def _workload_usage(args: argparse.Namespace, command: str) -> list[str]:
    """The usage problems every `workload` action shares: NAME, --domain, --wait."""
    problems = [p for p in (domain_problem(args.name, kind="workload"),) if p]
    if args.domain is not None and (problem := domain_problem(args.domain)):
        problems.append(problem)
    wait = getattr(args, "wait", None)
    if wait is not None and not 0 <= wait < float("inf"):
        problems.append(f"--wait {wait}: expected seconds >= 0")
    if command == "create":
        problems += _owner_problems(args)
    return problems


def _cmd_workload_create(args: argparse.Namespace) -> int:
    """`imexd workload create NAME --domain D [--nodes a,b] [--channel N] [--uid U]
    [--gid G] [--mode M] [--wait S] [--json]`."""
    nodes, problems = parse_nodes(args.nodes)
    problems = _workload_usage(args, "create") + problems
    if problems:
        return _usage("workload create", problems)
    from imexd.control import commands, workloads  # noqa: PLC0415 - lazy: only this command

    settings = commands.load_control_settings(args.config)
    return asyncio.run(
        workloads.create(
            settings,
            args.name,
            domain=args.domain,
            nodes=nodes,
            channel=args.channel,
            uid=args.uid,
            gid=args.gid,
            mode=args.mode,
            wait_s=args.wait,
            as_json=args.json,
            out=sys.stdout,
            err=sys.stderr,
        )
    )


def _cmd_workload_delete(args: argparse.Namespace) -> int:
    """`imexd workload delete NAME [--domain D] [--wait S]`."""
    problems = _workload_usage(args, "delete")
    if problems:
        return _usage("workload delete", problems)
    from imexd.control import commands, workloads  # noqa: PLC0415 - lazy: only this command

    settings = commands.load_control_settings(args.config)
    return asyncio.run(
        workloads.delete(
            settings,
            args.name,
            domain=args.domain,
            wait_s=args.wait,
            out=sys.stdout,
            err=sys.stderr,
        )
    )


def _cmd_workload_list(args: argparse.Namespace) -> int:
    """`imexd workload list [--domain D] [--json]`."""
    if args.domain is not None and (problem := domain_problem(args.domain)):
        return _usage("workload list", [problem])
    from imexd.control import commands, workloads  # noqa: PLC0415 - lazy: only this command

    settings = commands.load_control_settings(args.config)
    return asyncio.run(
        workloads.list_workloads(settings, domain=args.domain, as_json=args.json, out=sys.stdout)
    )


def _cmd_workload_status(args: argparse.Namespace) -> int:
    """`imexd workload status NAME [--domain D] [--wait S] [--json]`."""
    problems = _workload_usage(args, "status")
    if problems:
        return _usage("workload status", problems)
    from imexd.control import commands, workloads  # noqa: PLC0415 - lazy: only this command

    settings = commands.load_control_settings(args.config)
    return asyncio.run(
        workloads.status(
            settings,
            args.name,
            domain=args.domain,
            wait_s=args.wait,
            as_json=args.json,
            out=sys.stdout,
            err=sys.stderr,
        )
    )


def _cmd_workload_env(args: argparse.Namespace) -> int:
    """`imexd workload env NAME [--domain D]`."""
    problems = _workload_usage(args, "env")
    if problems:
        return _usage("workload env", problems)
    from imexd.control import commands, workloads  # noqa: PLC0415 - lazy: only this command

    settings = commands.load_control_settings(args.config)
    return asyncio.run(
        workloads.env(settings, args.name, domain=args.domain, out=sys.stdout, err=sys.stderr)
    )


def _cmd_node_assign(args: argparse.Namespace) -> int:
    """`imexd node assign NODE DOMAIN [--steal] [--force] [--seen-within S]`."""
    from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

    problems = [p for p in (node_problem(args.node), domain_problem(args.domain)) if p]
    seen_within = commands.SEEN_WITHIN_S if args.seen_within is None else args.seen_within
    if not seen_within >= 0:
        problems.append(f"--seen-within {seen_within}: expected seconds >= 0")
    if problems:
        return _usage("node assign", problems)
    settings = commands.load_control_settings(args.config)
    return asyncio.run(
        commands.assign(
            settings,
            args.node,
            args.domain,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
            force=args.force,
            seen_within_s=float(seen_within),
        )
    )


def _cmd_node_unassign(args: argparse.Namespace) -> int:
    """`imexd node unassign NODE`."""
    problems = [p for p in (node_problem(args.node),) if p]
    if problems:
        return _usage("node unassign", problems)
    from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

    settings = commands.load_control_settings(args.config)
    return asyncio.run(commands.assign(settings, args.node, None, out=sys.stdout, err=sys.stderr))


def _cmd_schemas(args: argparse.Namespace) -> int:
    """`imexd schemas --write DIR | --check DIR` (for developers and CI)."""
    from imexd.control import schemas  # noqa: PLC0415 - lazy: only this command pays for it

    if args.write:
        for path in schemas.write_schemas(Path(args.write)):
            print(path)
        return 0
    outdated = schemas.outdated_schemas(Path(args.check))
    if outdated:
        print(
            f"outdated in {args.check}: {', '.join(outdated)} "
            f"(run imexd schemas --write {args.check})",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """`imexd demo`: check the arguments (exit 2 when wrong), then run the demo."""
    from imexd.demo import scenario  # noqa: PLC0415 - lazy: only this command pays for it

    nodes: int = args.nodes
    if not scenario.MIN_NODES <= nodes <= scenario.MAX_NODES:
        print(
            f"imexd demo: --nodes {nodes}: expected {scenario.MIN_NODES}..{scenario.MAX_NODES}",
            file=sys.stderr,
        )
        return 2
    broker: str | None = args.broker
    if broker is not None:
        try:
            parse_broker_url(broker)
        except ValueError:
            print(
                f"imexd demo: --broker {broker}: expected mqtt://HOST[:PORT], "
                "mqtts://HOST[:PORT] or unix:///PATH",
                file=sys.stderr,
            )
            return 2
    options = scenario.Options(nodes=nodes, broker=broker)

    async def demo() -> int:
        # Ctrl-C, SIGTERM and SIGHUP only set the demo's stop event: it cleans up, then
        # exits 128 + the signal number.
        interrupt = scenario.Interrupt()
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        for sig in handled:
            loop.add_signal_handler(sig, interrupt.signal, sig)
        try:
            return await scenario.run_demo(options, sys.stdout, interrupt)
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    return asyncio.run(demo())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        handler: _Command = args.handler
        return handler(args)
    except ConfigError as exc:
        print(f"imexd: {exc}", file=sys.stderr)
        return 2
    except ImexdError as exc:
        print(f"imexd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`imexd status | head`): nothing left to say.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the exit flush
        return 141
