"""The `imexd` command line: argument parsing and dispatch, nothing else.

Each subcommand is a function `(args) -> exit code` in the module that owns the
concern, imported only when that subcommand runs (the simulator and the control plane
do not pay for the agent's imports). Exit codes: 0 success, 1 failure or not ready,
2 usage or configuration error; each command's --help lists its own. The control plane's
commands (domain, node, workload) are in imexd.cli.control, what all share in
imexd.cli.args. The agent's own command line (`imexd run --config FILE`) is read without
argparse, which the agent would otherwise hold, with every command's parser, while it runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol, cast

from imexd import __version__
from imexd.errors import ConfigError, ImexdError

if TYPE_CHECKING:
    import argparse

    from imexd.cli.args import SubParsers
    from imexd.settings import Settings


class _Command(Protocol):
    def __call__(self, args: argparse.Namespace) -> int: ...


RUN_EXITS: Final = (
    "0 stopped by SIGTERM or SIGINT (left the domain, daemon stopped); 75 the IMEX daemon "
    "was left running for the next agent to adopt (SIGUSR2 hand-over, or a failure of the "
    "agent itself); 1 a fatal error at start (e.g. the health port is taken: one line, "
    "before any log line); 2 invalid configuration, a file or program it names is missing, "
    "or [imex] run_dir cannot be created (nothing started)"
)
CONFIG_EXITS: Final = (
    "0 valid (the values, the example or the reference printed; a warning on stderr for "
    "what `imexd run` would start with but fail on, e.g. a node address of another host); "
    "2 invalid configuration, a problem in --env-file, a file or program the settings name "
    "is missing, or a run_dir no one can create"
)


def build_parser() -> argparse.ArgumentParser:
    # Here, not at the top: the agent's own command line is read without a parser (main).
    from imexd.cli.args import Parser, command, config_arg, seconds  # noqa: PLC0415
    from imexd.cli.control import add_control_commands  # noqa: PLC0415

    parser = Parser(
        prog="imexd",
        description="Node-local supervisor for the NVIDIA IMEX daemon.",
        epilog="exit codes: 0 success, 1 failure or not ready, 2 usage or configuration "
        "error; each command's --help lists its own.",
    )
    parser.add_argument("--version", action="version", version=f"imexd {__version__}")
    # Parser's subcommands are Parsers too (argparse makes them of the parser's class);
    # the helpers only need an ArgumentParser's methods.
    sub = cast(
        "SubParsers[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND"),
    )

    p = command(sub, "run", "run the agent (systemd service, container)", RUN_EXITS)
    config_arg(p)
    p.set_defaults(handler=_cmd_run)

    p = command(sub, "config", "validate settings and print the effective values", CONFIG_EXITS)
    config_arg(p)
    p.add_argument(
        "--env-file",
        default=None,
        metavar="FILE",
        help="read IMEXD_* variables from FILE as systemd's EnvironmentFile= does (e.g. "
        "/etc/imexd/imexd.env), instead of this shell's; a problem names the file's line "
        "(default: the shell's environment)",
    )
    p.add_argument(
        "--example",
        action="store_true",
        help="print the example file instead: every key set to its default, each with its "
        "explanation as a comment (config/imexd.toml)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="print the settings reference table of docs/configuration.md (for developers)",
    )
    p.set_defaults(handler=_cmd_config)

    p = command(
        sub,
        "render",
        "dry run: print the files the agent would write",
        "0 printed or written; 1 --out cannot be written; 2 invalid settings or member records",
    )
    config_arg(p)
    p.add_argument(
        "--members", required=True, metavar="FILE", help="JSON file: a list of MemberRecords"
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write the files into this folder (default: print them)",
    )
    p.set_defaults(handler=_cmd_render)

    p = command(
        sub,
        "discover",
        "discover the GPU fabric clique through NVML",
        "0 a clique found (the report printed as JSON); 1 NVML failed or the GPUs disagree "
        "(the reason on stderr); 2 a bad --timeout",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=20.0,
        metavar="SECONDS",
        help="how long the NVML child may take (default %(default)g)",
    )
    p.set_defaults(handler=_cmd_discover)

    p = command(
        sub,
        "check",
        "exec probe: exit 0 when the local agent is ready",
        "0 ready (live, with --live); 1 not ready, or the agent unreachable; 2 invalid "
        "configuration",
    )
    config_arg(p)
    _agent_url_args(p)
    p.add_argument("--live", action="store_true", help="check /healthz instead of /readyz")
    p.set_defaults(handler=_cmd_check)

    p = command(
        sub,
        "status",
        "the local agent's state, for a person",
        "0 shown; 1 the agent unreachable or its answer unusable; 2 invalid configuration",
    )
    config_arg(p)
    _agent_url_args(p)
    p.add_argument(
        "--json", action="store_true", help="print the HealthReport JSON (default: text)"
    )
    p.set_defaults(handler=_cmd_status)

    add_control_commands(sub)

    p = command(
        sub,
        "schemas",
        "for developers: write or check the bus payloads' JSON Schemas (docs/schemas)",
        "0 written, or up to date; 1 outdated",
    )
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="DIR", help="write the schemas into DIR")
    action.add_argument("--check", metavar="DIR", help="exit 1 if DIR's schemas differ")
    p.set_defaults(handler=_cmd_schemas)

    p = sub.add_parser(
        "keys",
        help="the control plane's signing keys: create",
        description="The control plane's signing keys. exit codes: see each action's --help.",
    )
    ksub = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    q = command(
        ksub,
        "create",
        "make an Ed25519 key pair: DIR/control.key (private, mode 0600) for [control] "
        "private_key, DIR/control.pub for the agents' [control] public_key",
        "0 made (both paths and the key's fingerprint printed); 2 DIR is not a folder that "
        "can be created or written, or control.key or control.pub exists there (nothing "
        "written, nothing overwritten)",
    )
    q.add_argument("dir", metavar="DIR", help="the folder of the two files (created if missing)")
    q.set_defaults(handler=_cmd_keys_create)

    p = command(
        sub,
        "demo",
        "form a domain of simulated nodes on this machine",
        "0 the demo ran to its end; 1 it failed (or cleaning up did); 2 bad arguments; "
        "128 + N stopped by signal N (130: Ctrl-C)",
    )
    p.add_argument(
        "--nodes", type=int, default=4, help="how many simulated nodes (default %(default)s)"
    )
    p.add_argument(
        "--broker",
        default=None,
        metavar="URL",
        help="use this broker instead of starting one (default: the demo starts a private "
        "broker on a free port: mosquitto when installed, else amqtt inside the demo; "
        "IMEXD_DEMO_BROKER=mosquitto|amqtt chooses)",
    )
    p.set_defaults(handler=_cmd_demo)
    return parser


def _agent_url_args(parser: argparse.ArgumentParser) -> None:
    from imexd.cli.args import seconds  # noqa: PLC0415 - with the parser

    parser.add_argument(
        "--url",
        default=None,
        help="agent base URL, e.g. http://127.0.0.1:9440 (default: from [health] listen "
        "of the settings file)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=3.0,
        metavar="SECONDS",
        help="how long to wait for the agent's answer (default %(default)g)",
    )


def _cmd_config(args: argparse.Namespace) -> int:
    """Print the effective settings (file + environment) as TOML-like lines, after the
    checks `imexd run` makes (files and programs the settings name)."""
    from imexd import preflight  # noqa: PLC0415 - lazy: only this command pays for it
    from imexd.settings import iter_settings, load_settings  # noqa: PLC0415
    from imexd.settings_text import example_toml, reference_markdown  # noqa: PLC0415

    if args.example:
        print(example_toml(), end="")
        return 0
    if args.reference:
        print(reference_markdown(), end="")
        return 0
    if args.env_file is None:
        settings = load_settings(args.config)
    else:
        settings = _load_with_env_file(args.config, args.env_file)
    preflight.check(settings, programs=True)
    for warning in preflight.warnings(settings):
        print(f"imexd config: warning: {warning}", file=sys.stderr)
    for info in iter_settings():
        value = getattr(getattr(settings, info.section), info.key)
        if isinstance(value, tuple):
            value = list(value)
        elif info.kind == "table":
            value = dict(value)
        print(f"{info.section}.{info.key} = {value!r}")
    return 0


def _load_with_env_file(config: str | None, env_file: str) -> Settings:
    """The settings as the systemd unit gives them to the agent: the file, then the
    variables of `env_file` (not this shell's). Warnings go to stderr."""
    from imexd.envfile import read_env_file  # noqa: PLC0415 - lazy: only this option
    from imexd.settings import ENV_PREFIX, env_setting, load_settings  # noqa: PLC0415

    parsed = read_env_file(env_file)
    warnings = list(parsed.warnings)
    # A name of a settings section is checked by load_settings (an unknown key there is
    # an error); only the others are ignored, and said so.
    warnings += [
        f"{parsed.labels[name]}: not a setting (known: IMEXD_<SECTION>_<KEY>, see "
        "docs/configuration.md); imexd ignores it"
        for name in parsed.environ
        if name.startswith(ENV_PREFIX) and env_setting(name) is None
    ]
    for warning in warnings:
        print(f"imexd config: warning: {warning}", file=sys.stderr)
    return load_settings(config, environ=parsed.environ, env_labels=parsed.labels)


def _cmd_run(args: argparse.Namespace) -> int:
    """`imexd run` as argparse read it (a form `_plain_run` leaves to the parser)."""
    config: str | None = args.config
    return _run_agent(config)


def _run_agent(config: str | None) -> int:
    """`imexd run`: validate the settings (exit 2 when wrong), then run the agent.

    Signals only set events: SIGTERM/SIGINT `stop` (leave: clear the record, stop the
    daemon, exit 0), SIGUSR2 `handover` and `stop` (exit 75, daemon left running).
    """
    import asyncio  # noqa: PLC0415 - lazy: --version and --help do not pay for it

    # The agent logs JSON lines or plain console lines. structlog imports rich (and rich
    # pygments) wherever rich is installed, for a traceback style the agent never uses,
    # at a cost in every agent's memory (docs/performance.md). None in sys.modules makes
    # that import fail here, in the agent's process only, as if rich were absent.
    sys.modules.setdefault("rich", None)  # type: ignore[arg-type]
    from imexd.cli.deferred import defer_unused_imports  # noqa: PLC0415

    defer_unused_imports()
    from imexd import preflight  # noqa: PLC0415 - lazy: only this command pays for it
    from imexd.agent.run import run as run_agent  # noqa: PLC0415 - lazy, as above
    from imexd.logs import configure_logging, get_logger, install_loop_handler  # noqa: PLC0415
    from imexd.settings import load_settings  # noqa: PLC0415 - with the agent

    settings = load_settings(config)
    # A missing program or file is fatal for the agent: say which now, not after retries.
    preflight.check(settings, programs=True, agent=True)
    configure_logging(settings.log.level, settings.log.format)
    log = get_logger("agent")

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
            return await run_agent(settings, stop=stop, handover=handover)
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

    try:
        doc, failure = fabric.discover_report(float(args.timeout))
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
    from imexd.cli import query  # noqa: PLC0415 - lazy: only this command pays for it

    base = query.base_url(args.url, args.config)
    return query.check(base, live=bool(args.live), timeout=float(args.timeout))


def _cmd_status(args: argparse.Namespace) -> int:
    """`imexd status`: the local agent's HealthReport for a person (or --json)."""
    from imexd.cli import query  # noqa: PLC0415 - lazy: only this command pays for it

    base = query.base_url(args.url, args.config)
    return query.status(base, as_json=bool(args.json), timeout=float(args.timeout))


def _cmd_keys_create(args: argparse.Namespace) -> int:
    """`imexd keys create DIR`: a new key pair, never over an existing file."""
    from imexd import signing  # noqa: PLC0415 - lazy: only this command loads cryptography

    try:
        private, public, fingerprint = signing.create_keys(args.dir)
    except signing.KeysError as exc:
        print(f"imexd keys create: {exc}", file=sys.stderr)
        return 2
    print(f"private key: {private} (mode 0600: [control] private_key of the control plane)")
    print(f"public key:  {public} ([control] public_key of every agent)")
    print(f"fingerprint: {fingerprint} (what `imexd status` shows on a node that verifies)")
    return 0


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
    import asyncio  # noqa: PLC0415 - lazy: --version and --help do not pay for it

    from imexd.cli.args import run_async  # noqa: PLC0415 - with the parser
    from imexd.demo import scenario  # noqa: PLC0415 - lazy: only this command pays for it
    from imexd.settings import parse_broker_url  # noqa: PLC0415 - with the demo

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

    return run_async(demo())


class _PlainRun(NamedTuple):
    config: str | None


def _plain_run(words: Sequence[str]) -> _PlainRun | None:
    """`imexd run`, `imexd run --config FILE` (or `-c FILE`, `--config=FILE`): the command
    lines of the service and the container, read without argparse, so that the agent
    holds neither argparse nor the parser of every command for its whole life. None for
    any other command line (`run --help`, an abbreviated option...): argparse reads it.
    """
    if not words or words[0] != "run":
        return None
    match words[1:]:
        case []:
            return _PlainRun(None)
        case ["-c" | "--config", path] if not path.startswith("-"):
            return _PlainRun(path)
        case [option] if option.startswith("--config=") and len(option) > len("--config="):
            return _PlainRun(option.removeprefix("--config="))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    plain = _plain_run(words)
    if plain is None:
        args = build_parser().parse_args(words)
        handler: _Command = args.handler
        command = functools.partial(handler, args)
    else:
        command = functools.partial(_run_agent, plain.config)
    try:
        return command()
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
