"""The control plane's subcommands: `imexd domain`, `imexd node`, `imexd workload`, `imexd gc`.

Their parsers and their handlers: each handler checks its arguments and hands the problems
and its coroutine of imexd.control to `_run_control`, which exits 2 on a usage error before
any broker is tried, else loads the settings with
`imexd.control.commands.load_control_settings` and runs the coroutine.
Apart from imexd.cli.main, which holds the agent's own commands and the entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Final

from imexd.cli.args import (
    SubParsers,
    command,
    config_arg,
    integer,
    owner_args,
    owner_problems,
    run_async,
    usage,
)
from imexd.cli.deferred import defer_unused_imports
from imexd.names import (
    domain_problem,
    max_nodes_problem,
    node_problem,
    parse_job_ids,
    parse_nodes,
)

if TYPE_CHECKING:
    from imexd.settings import Settings

SEEN_WITHIN_DEFAULT_S: Final = 600.0
"""`--seen-within` default of `domain create` and `node assign`: imexd.control.commands'
SEEN_WITHIN_S (not imported here: the parser must not pay for the control plane)."""
BUS_EXITS: Final = "1 a bus error (broker unreachable, or it did not keep a write)"
CREATE_WAIT_S: Final = 240.0
"""`domain create --wait` without a value: as long as the shipped Slurm prolog waits."""

DOMAIN_EXITS: Final = {
    "create": "0 written (with --wait: and the domain UP, and with --channel too every "
    "listed node has the channel); 1 "
    + BUS_EXITS[2:]
    + ", with --channel the workload's failure, or with --wait not UP (or the channel "
    "not ready) by the deadline, the spec kept; 2 usage error, a listed node in "
    "another live domain (without --steal), or a listed node that no agent reported "
    "within --seen-within (without --force), nothing written; 3 with --channel: no free "
    "channel",
    "delete": "0 deleted (or nothing to delete, or the spec kept for nodes that name the "
    "domain in their settings); 1 members still hold records at the end of --wait (run "
    "it again), or a bus error; 2 usage error",
    "list": f"0 listed; {BUS_EXITS}; 2 usage error",
    "status": "0 the domain is UP; 1 not UP (at the end of --wait), nothing on the bus "
    "about it, or a bus error; 2 usage error; with --watch: that of the last state drawn",
}
NODE_EXITS: Final = {
    "assign": f"0 assigned; {BUS_EXITS}; 2 usage error, the node in another live domain "
    "(without --steal), or no agent reported it within --seen-within (without --force)",
    "unassign": f"0 unassigned; {BUS_EXITS}; 2 usage error",
    "forget": f"0 forgotten (or nothing to forget); {BUS_EXITS}; 2 usage error, the node "
    "is live (an agent reported it within --seen-within and it holds a record that is not "
    "lost), or it holds such a record and was not reported (without --force), nothing "
    "written",
    "retry": f"0 the daemon runs (or ran already); 1 not running after --wait seconds, or "
    f"{BUS_EXITS.removeprefix('1 ')}; 2 usage error, or the node's agent is down, unknown or in "
    "no domain, nothing written",
}
WORKLOAD_EXITS: Final = {
    "create": "0 ready on every listed node (or written, with --wait 0); 1 not "
    "ready by the deadline (the record is kept), a lost race retried too often, or a bus "
    "error; 2 usage error (bad name or mode, --channel used by another workload of the "
    "domain, the workload exists on another channel); 3 no free channel",
    "delete": "0 deleted and no node lists it any more; 1 no such workload, "
    "nodes still list it at the deadline, or a bus error; 2 usage error",
    "list": "0 listed; 1 bus error; 2 usage error",
    "status": "0 every listed node has the channel ready; 1 not ready, no such "
    "workload, or a bus error; 2 usage error (also: NAME in several domains and no --domain)",
    "env": "0 printed; 1 no such workload, not active, or not ready on every node it "
    "lists (the reason on stderr, nothing on stdout), or a bus error; 2 usage error",
}
GC_EXITS: Final = (
    "0 listed (without --apply), or every candidate not in use deleted; 1 a delete failed "
    "(its own message says why), or a bus error; 2 usage error: no selector, a word of "
    "--live-jobs that is not a job id, an unreadable --live-jobs-file, a negative "
    "--older-than or --wait"
)
GC_DESCRIPTION: Final = (
    "List, and with --apply delete, what failed Slurm epilogs left on the bus: domains and "
    "workloads named job-<id> whose job is not in the live job list (nor above every "
    "listed id: such a job may have started after the list was taken), and/or workloads "
    "created more than --older-than seconds ago (a domain spec has no creation time: age "
    "applies to workloads only). Each selector given must select a record. In use, and "
    "kept with the reason, is a workload selected by age alone whose channel a node "
    "reports ready; with a job list, a record of a job that is not running is not in use, "
    "even while its daemons run. Deletes go through `workload delete` and `domain delete`."
)


def add_control_commands(sub: SubParsers[argparse.ArgumentParser]) -> None:
    """Add `domain`, `workload`, `node` with their actions, and `gc`."""
    _domain_parser(sub)
    _workload_parser(sub)
    _node_parser(sub)
    _gc_parser(sub)


def _seen_args(
    parser: argparse.ArgumentParser, what: str, *, force_help: str | None = None
) -> None:
    parser.add_argument(
        "--force",
        action="store_true",
        help=force_help or f"{what} even when no agent reported it within --seen-within seconds",
    )
    parser.add_argument(
        "--seen-within",
        type=float,
        default=SEEN_WITHIN_DEFAULT_S,
        metavar="SECONDS",
        help="how recently an agent must have reported the node: its presence record or "
        "health report, sent every [health] report_interval_s (30 s), or a live member "
        "record (default %(default)g)",
    )


def _domain_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "domain",
        help="control plane: create, delete, list, status",
        description="Control plane: IMEX domains. exit codes: see each action's --help.",
    )
    dsub = p.add_subparsers(dest="domain_command", required=True, metavar="ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        q = command(dsub, name, help_text, DOMAIN_EXITS[name])
        config_arg(q)
        return q

    q = action("create", "publish a DomainSpec (and assignments)")
    q.add_argument("name", help="the domain's name (DNS-1123 label)")
    q.add_argument(
        "--nodes",
        default=None,
        help="comma-separated node names, in slot order, each assigned to the domain "
        "(default: no list, any node assigned to it joins)",
    )
    q.add_argument(
        "--max-nodes",
        type=integer,
        default=None,
        help="slots per clique (default: the existing spec's, else [domain] max_nodes)",
    )
    q.add_argument(
        "--steal",
        action="store_true",
        help="take listed nodes out of another live domain (stops their daemons there)",
    )
    _seen_args(q, "list a node")
    q.add_argument(
        "--channel",
        type=integer,
        nargs="?",
        const=0,
        default=None,
        metavar="N",
        help="also create workload NAME in this domain on IMEX channel N (no value: 0), "
        "for one domain per job (default: no workload)",
    )
    owner_args(q, "with --channel: ")
    q.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=CREATE_WAIT_S,
        default=None,
        metavar="SECONDS",
        help="then wait up to this long for the domain to be UP (and with --channel for "
        "every listed node to have the channel), returning the moment it is, and print "
        "the judgement as `domain status` does: one command for a Slurm prolog (no value: "
        f"{CREATE_WAIT_S:g}; default: do not wait)",
    )
    q.set_defaults(handler=_cmd_domain_create)

    q = action("delete", "delete a domain: agents stop their daemons; its workloads are cleared")
    q.add_argument("name", help="the domain's name")
    q.add_argument(
        "--wait",
        "--timeout",
        dest="wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the members to leave, returning the moment the domain "
        "is gone (default %(default)g; --timeout is the old name)",
    )
    q.set_defaults(handler=_cmd_domain_delete)

    q = action("list", "list domains with a spec or members")
    q.set_defaults(handler=_cmd_domain_list)

    q = action("status", "one table from the members' HealthReports")
    q.add_argument("name", help="the domain's name")
    q.add_argument(
        "--json", action="store_true", help="print the judgement as JSON (default: a table)"
    )
    q.add_argument(
        "--watch",
        action="store_true",
        help="redraw on every change until Ctrl-C (--wait does not apply)",
    )
    q.add_argument(
        "--wait",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="after the retained snapshot, wait up to this long for the domain to be UP, "
        "returning the moment it is (default %(default)g; 0: judge the snapshot only). "
        "Without a spec and without --nodes it cannot be UP: the snapshot is judged at once",
    )
    q.add_argument(
        "--nodes",
        default=None,
        help="comma-separated nodes the domain must have (default: the spec's list, else "
        "the nodes with a member record)",
    )
    q.set_defaults(handler=_cmd_domain_status)


def _node_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "node",
        help="control plane: assign nodes to domains",
        description="Control plane: node assignments. exit codes: see each action's --help.",
    )
    nsub = p.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    q = command(nsub, "assign", "assign NODE to DOMAIN", NODE_EXITS["assign"])
    config_arg(q)
    q.add_argument("node", help="the node's name ([node] name)")
    q.add_argument("domain", help="the domain's name")
    q.add_argument(
        "--steal",
        action="store_true",
        help="move the node out of another live domain (stops its daemon there)",
    )
    _seen_args(q, "assign the node")
    q.set_defaults(handler=_cmd_node_assign)
    q = command(nsub, "unassign", "take NODE out of its domain", NODE_EXITS["unassign"])
    config_arg(q)
    q.add_argument("node", help="the node's name")
    q.set_defaults(handler=_cmd_node_unassign)
    q = command(
        nsub,
        "forget",
        "clear what a node gone for good left: its lost member record, reports, presence",
        NODE_EXITS["forget"],
    )
    config_arg(q)
    q.add_argument("node", help="the node's name")
    _seen_args(
        q,
        "clear",
        force_help="also clear a record that is not lost (a will that never fired) when no "
        "agent reported the node within --seen-within seconds; never a live node's",
    )
    q.set_defaults(handler=_cmd_node_forget)
    q = command(
        nsub,
        "retry",
        "start NODE's failed daemon now: end FATAL's cool-down once the cause is fixed",
        NODE_EXITS["retry"],
    )
    config_arg(q)
    q.add_argument("node", help="the node's name")
    q.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds to wait for the node to report its daemon RUNNING (default 60)",
    )
    q.set_defaults(handler=_cmd_node_retry)


def _domain_arg(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    if required:
        parser.add_argument("--domain", required=True, help="the workload's domain (required)")
    else:
        parser.add_argument(
            "--domain",
            default=None,
            help="the workload's domain (default: the one domain that has a workload NAME)",
        )


def _workload_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    """`imexd workload create|delete|list|status|env`: IMEX channels for named workloads."""
    p = sub.add_parser(
        "workload",
        help="control plane: IMEX channels for workloads (create, delete, ...)",
        description="Control plane: IMEX channels for workloads. exit codes: see each "
        "action's --help.",
    )
    wsub = p.add_subparsers(dest="workload_command", required=True, metavar="ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        q = command(wsub, name, help_text, WORKLOAD_EXITS[name])
        config_arg(q)
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
    owner_args(q)
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

    q = action("env", "print `export` lines for a ready workload's channel (Slurm TaskProlog)")
    q.add_argument("name", help="the workload's name")
    _domain_arg(q)
    q.set_defaults(handler=_cmd_workload_env)


def _run_control(
    args: argparse.Namespace,
    command_words: str,
    problems: Sequence[str],
    call: Callable[[Settings], Coroutine[Any, Any, int]],
) -> int:
    """Exit 2 on `problems` before imexd.control is imported (a usage error pays for neither
    asyncio nor msgspec), else run `call` on the loaded settings. `call` imports the control
    module it calls itself: one handed in from here would be untyped."""
    if problems:
        return usage(command_words, problems)
    defer_unused_imports()
    from imexd.control import commands  # noqa: PLC0415 - lazy: see the docstring

    return run_async(call(commands.load_control_settings(args.config)))


def _cmd_domain_create(args: argparse.Namespace) -> int:
    """`imexd domain create NAME [--nodes a,b,c] [--max-nodes N] [--steal] [--force]
    [--seen-within S] [--channel [N] [--uid U] [--gid G] [--mode M]] [--wait [S]]`: with
    --channel, workload NAME of the domain too; with --wait, then what `domain status
    --wait` (and with --channel `workload status --wait`) would print and exit."""
    nodes, problems = parse_nodes(args.nodes)
    problems = [
        p for p in (domain_problem(args.name), max_nodes_problem(args.max_nodes)) if p
    ] + problems
    problems += owner_problems(args) + _seen_problems(args)
    if args.wait is not None and not 0 <= args.wait < float("inf"):
        problems.append(f"--wait {args.wait}: expected seconds >= 0")
    if args.channel is None:
        given = [f"--{o}" for o in ("uid", "gid", "mode") if getattr(args, o) is not None]
        if given:
            problems.append(f"{', '.join(given)} only go with --channel")

    async def call(settings: Settings) -> int:
        from imexd.control import commands, workloads  # noqa: PLC0415 - lazy: only this command

        started = time.monotonic()
        code = await commands.create(
            settings,
            args.name,
            nodes=nodes,
            max_nodes=args.max_nodes,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
            force=args.force,
            seen_within_s=args.seen_within,
        )
        if code == 0 and args.channel is not None:
            code = await workloads.create(
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
        if code != 0 or args.wait is None:
            return code
        # `domain status --wait` and `workload status --wait` themselves, in one deadline.
        code = await commands.status(
            settings, args.name, as_json=False, wait=args.wait, out=sys.stdout, err=sys.stderr
        )
        if code != 0 or args.channel is None:
            return code
        return await workloads.status(
            settings,
            args.name,
            domain=args.name,
            wait_s=max(0.0, args.wait - (time.monotonic() - started)),
            as_json=False,
            out=sys.stdout,
            err=sys.stderr,
        )

    return _run_control(args, "domain create", problems, call)


def _seen_problems(args: argparse.Namespace) -> list[str]:
    if 0 <= args.seen_within < float("inf"):
        return []
    return [f"--seen-within {args.seen_within:g}: expected seconds >= 0"]


def _cmd_domain_delete(args: argparse.Namespace) -> int:
    """`imexd domain delete NAME [--wait S]`."""
    problems = [p for p in (domain_problem(args.name),) if p]
    if not args.wait >= 0:
        problems.append(f"--wait {args.wait}: expected seconds >= 0")

    async def call(settings: Settings) -> int:
        from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

        return await commands.delete(
            settings, args.name, wait_s=args.wait, out=sys.stdout, err=sys.stderr
        )

    return _run_control(args, "domain delete", problems, call)


def _cmd_domain_list(args: argparse.Namespace) -> int:
    """`imexd domain list`."""

    async def call(settings: Settings) -> int:
        from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

        return await commands.list_domains(settings, out=sys.stdout, err=sys.stderr)

    return _run_control(args, "domain list", [], call)


def _cmd_domain_status(args: argparse.Namespace) -> int:
    """`imexd domain status NAME [--nodes a,b] [--json] [--watch] [--wait S]`.

    With --watch, SIGINT and SIGTERM only set the watch's stop event: it returns the exit
    status of the last state it drew.
    """
    nodes, problems = parse_nodes(args.nodes)
    problems = [p for p in (domain_problem(args.name),) if p] + problems
    if not args.wait >= 0:
        problems.append(f"--wait {args.wait}: expected seconds >= 0")

    async def call(settings: Settings) -> int:
        from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

        if not args.watch:
            return await commands.status(
                settings,
                args.name,
                as_json=args.json,
                wait=args.wait,
                out=sys.stdout,
                err=sys.stderr,
                nodes=nodes,
            )
        import asyncio  # noqa: PLC0415 - lazy: --help and usage errors do not pay for it

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

    return _run_control(args, "domain status", problems, call)


def _workloadusage(args: argparse.Namespace, command: str) -> list[str]:
    """The usage problems every `workload` action shares: NAME, --domain, --wait."""
    problems = [p for p in (domain_problem(args.name, kind="workload"),) if p]
    if args.domain is not None and (problem := domain_problem(args.domain)):
        problems.append(problem)
    wait = getattr(args, "wait", None)
    if wait is not None and not 0 <= wait < float("inf"):
        problems.append(f"--wait {wait}: expected seconds >= 0")
    if command == "create":
        problems += owner_problems(args)
    return problems


def _cmd_workload_create(args: argparse.Namespace) -> int:
    """`imexd workload create NAME --domain D [--nodes a,b] [--channel N] [--uid U]
    [--gid G] [--mode M] [--wait S] [--json]`."""
    nodes, problems = parse_nodes(args.nodes)

    async def call(settings: Settings) -> int:
        from imexd.control import workloads  # noqa: PLC0415 - lazy: only this command

        return await workloads.create(
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

    return _run_control(args, "workload create", _workloadusage(args, "create") + problems, call)


def _cmd_workload_delete(args: argparse.Namespace) -> int:
    """`imexd workload delete NAME [--domain D] [--wait S]`."""

    async def call(settings: Settings) -> int:
        from imexd.control import workloads  # noqa: PLC0415 - lazy: only this command

        return await workloads.delete(
            settings,
            args.name,
            domain=args.domain,
            wait_s=args.wait,
            out=sys.stdout,
            err=sys.stderr,
        )

    return _run_control(args, "workload delete", _workloadusage(args, "delete"), call)


def _cmd_workload_list(args: argparse.Namespace) -> int:
    """`imexd workload list [--domain D] [--json]`."""
    problems = [] if args.domain is None else [p for p in (domain_problem(args.domain),) if p]

    async def call(settings: Settings) -> int:
        from imexd.control import workloads  # noqa: PLC0415 - lazy: only this command

        return await workloads.list_workloads(
            settings, domain=args.domain, as_json=args.json, out=sys.stdout, err=sys.stderr
        )

    return _run_control(args, "workload list", problems, call)


def _cmd_workload_status(args: argparse.Namespace) -> int:
    """`imexd workload status NAME [--domain D] [--wait S] [--json]`."""

    async def call(settings: Settings) -> int:
        from imexd.control import workloads  # noqa: PLC0415 - lazy: only this command

        return await workloads.status(
            settings,
            args.name,
            domain=args.domain,
            wait_s=args.wait,
            as_json=args.json,
            out=sys.stdout,
            err=sys.stderr,
        )

    return _run_control(args, "workload status", _workloadusage(args, "status"), call)


def _cmd_workload_env(args: argparse.Namespace) -> int:
    """`imexd workload env NAME [--domain D]`."""

    async def call(settings: Settings) -> int:
        from imexd.control import workloads  # noqa: PLC0415 - lazy: only this command

        return await workloads.env(
            settings, args.name, domain=args.domain, out=sys.stdout, err=sys.stderr
        )

    return _run_control(args, "workload env", _workloadusage(args, "env"), call)


def _cmd_node_assign(args: argparse.Namespace) -> int:
    """`imexd node assign NODE DOMAIN [--steal] [--force] [--seen-within S]`."""
    problems = [p for p in (node_problem(args.node), domain_problem(args.domain)) if p]

    async def call(settings: Settings) -> int:
        from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

        return await commands.assign(
            settings,
            args.node,
            args.domain,
            out=sys.stdout,
            err=sys.stderr,
            steal=args.steal,
            force=args.force,
            seen_within_s=args.seen_within,
        )

    return _run_control(args, "node assign", problems + _seen_problems(args), call)


def _cmd_node_unassign(args: argparse.Namespace) -> int:
    """`imexd node unassign NODE`."""

    async def call(settings: Settings) -> int:
        from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

        return await commands.assign(settings, args.node, None, out=sys.stdout, err=sys.stderr)

    return _run_control(args, "node unassign", [p for p in (node_problem(args.node),) if p], call)


def _cmd_node_forget(args: argparse.Namespace) -> int:
    """`imexd node forget NODE [--force] [--seen-within S]`."""
    problems = [p for p in (node_problem(args.node),) if p]

    async def call(settings: Settings) -> int:
        from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

        return await commands.forget(
            settings,
            args.node,
            out=sys.stdout,
            err=sys.stderr,
            force=args.force,
            seen_within_s=args.seen_within,
        )

    return _run_control(args, "node forget", problems + _seen_problems(args), call)


def _cmd_node_retry(args: argparse.Namespace) -> int:
    """`imexd node retry NODE [--wait S]`."""
    problems = [p for p in (node_problem(args.node),) if p]
    if not args.wait > 0:
        problems.append(f"--wait must be a number of seconds > 0, got {args.wait:g}")

    async def call(settings: Settings) -> int:
        from imexd.control import commands  # noqa: PLC0415 - lazy: only this command pays for it

        return await commands.retry(
            settings, args.node, wait_s=args.wait, out=sys.stdout, err=sys.stderr
        )

    return _run_control(args, "node retry", problems, call)


def _gc_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = command(sub, "gc", "control plane: find and delete what dead Slurm jobs left", GC_EXITS)
    p.description = GC_DESCRIPTION
    config_arg(p)
    jobs = p.add_mutually_exclusive_group()
    jobs.add_argument(
        "--live-jobs",
        default=None,
        metavar="IDS",
        help="the running jobs' ids, separated by whitespace or commas, as `squeue -h -o %%A` "
        'prints them ("": no job runs); selects job-<id> records of other ids',
    )
    jobs.add_argument(
        "--live-jobs-file",
        default=None,
        metavar="FILE",
        help="the same ids read from FILE (-: standard input)",
    )
    p.add_argument(
        "--older-than",
        type=float,
        default=None,
        metavar="SECONDS",
        help="selects workloads created more than this long ago (default: age not used)",
    )
    p.add_argument(
        "--tombstones",
        type=float,
        default=None,
        metavar="SECONDS",
        help="selects tombstones (deleted specs and workloads, assignments to no domain) "
        "written more than this long ago, to clear them (default: none)",
    )
    p.add_argument(
        "--apply",
        action="store_true",
        help="delete the candidates not in use (default: only list them)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="each delete's --wait (default %(default)g)",
    )
    p.set_defaults(handler=_cmd_gc)


def _live_jobs_text(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The text of --live-jobs or --live-jobs-file (None: neither given), and problems."""
    if args.live_jobs_file is None:
        return args.live_jobs, []
    try:
        if args.live_jobs_file == "-":
            return sys.stdin.read(), []
        with open(args.live_jobs_file, encoding="utf-8") as f:
            return f.read(), []
    except (OSError, UnicodeDecodeError) as exc:
        return None, [f"--live-jobs-file {args.live_jobs_file}: cannot read it: {exc}"]


def _cmd_gc(args: argparse.Namespace) -> int:
    """`imexd gc [--live-jobs IDS | --live-jobs-file FILE|-] [--older-than S]
    [--tombstones S] [--apply] [--wait S]`: at least one selector, so that gc never
    selects everything."""
    text, problems = _live_jobs_text(args)
    live_jobs = None
    if text is not None:
        live_jobs, bad = parse_job_ids(text)
        if bad:
            problems.append(
                f"--live-jobs: not a job id: {', '.join(repr(w) for w in bad)} (expected "
                "plain numeric ids, as `squeue -h -o %A` prints them)"
            )
    if text is None and args.older_than is None and args.tombstones is None and not problems:
        problems.append(
            "give --live-jobs, --live-jobs-file, --older-than or --tombstones: gc without a "
            "selector would select everything"
        )
    for name, value in (("--older-than", args.older_than), ("--tombstones", args.tombstones)):
        if value is not None and not 0 <= value < float("inf"):
            problems.append(f"{name} {value:g}: expected seconds >= 0")
    if not 0 <= args.wait < float("inf"):
        problems.append(f"--wait {args.wait:g}: expected seconds >= 0")

    async def call(settings: Settings) -> int:
        from imexd.control import gc  # noqa: PLC0415 - lazy: only this command

        return await gc.gc(
            settings,
            live_jobs=live_jobs,
            older_than_s=args.older_than,
            tombstones_s=args.tombstones,
            apply=args.apply,
            wait_s=args.wait,
            out=sys.stdout,
            err=sys.stderr,
        )

    return _run_control(args, "gc", problems, call)
