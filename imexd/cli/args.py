"""What every `imexd` subcommand's arguments share: argument types, the common options,
the exit codes in each command's help, and the one-line usage errors.

Apart from imexd.cli.main (the agent's commands and the entry point) and imexd.cli.control
(the control plane's), which both build on it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, Final, NoReturn

MAX_CHANNEL: Final = (1 << 20) - 1
"""imexd.messages' MAX_CHANNEL, and DEFAULT_CONFIG_PATH imexd.settings': not imported
here, so that parsing (and --version, --help) pays for neither msgspec nor psutil."""
DEFAULT_CONFIG_PATH: Final = "/etc/imexd/imexd.toml"
MAX_ID: Final = 4294967294
"""The largest uid or gid a channel device may be given (-1 means "unchanged" to chown)."""
EXIT_USAGE: Final = 2

SubParsers = argparse._SubParsersAction
"""argparse's type of the object add_subparsers() returns."""

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


class Parser(argparse.ArgumentParser):
    """argparse with two kindnesses: an unknown option is reported with the usage of the
    (sub)command it was given to, and a mistyped command name gets a "did you mean"."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            owner: argparse.ArgumentParser = getattr(parsed, "usage_parser", self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        found = _INVALID_CHOICE.search(message)
        if found:
            import difflib  # noqa: PLC0415 - lazy: only a mistyped command pays for it

            choices = re.findall(r"'([^']*)'", found.group(2))
            close = difflib.get_close_matches(found.group(1), choices, n=1)
            if close:
                message += f"; did you mean '{close[0]}'?"
        super().error(message)


def command(
    sub: SubParsers[argparse.ArgumentParser], name: str, help_text: str, exits: str
) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does and, last, its exit codes."""
    parser = sub.add_parser(
        name,
        help=help_text,
        description=help_text[:1].upper() + help_text[1:] + ".",
        epilog=f"exit codes: {exits}",
    )
    parser.set_defaults(usage_parser=parser)  # the innermost command's wins: see Parser
    return parser


def config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        default=None,
        metavar="FILE",
        help=f"settings file (TOML); default {DEFAULT_CONFIG_PATH}, where an absent file "
        "means the defaults",
    )


def integer(text: str) -> int:
    """An integer option (argparse reports a ValueError as a usage error naming it)."""
    return int(text, 10)


def seconds(text: str) -> float:
    """A duration option that must be positive (`--timeout`): a usage error otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds > 0")
    return value


def mode_arg(text: str) -> int:
    """`--mode`: octal permission bits such as 0660, 660 or 0o660."""
    digits = text.removeprefix("0o")
    if not digits or any(c not in "01234567" for c in digits):
        raise argparse.ArgumentTypeError(f"{text!r}: expected octal permission bits such as 0660")
    mode = int(digits, 8)
    if mode > 0o777:
        raise argparse.ArgumentTypeError(f"{text!r}: expected permission bits 0000 to 0777")
    return mode


def owner_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
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
        type=mode_arg,
        default=None,
        help=f"{prefix}permission bits of the channel device, octal (default 0660)",
    )


def owner_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with --channel, --uid and --gid (--mode is checked by argparse)."""
    problems: list[str] = []
    if args.channel is not None and not 0 <= args.channel <= MAX_CHANNEL:
        problems.append(f"--channel {args.channel}: expected 0 to {MAX_CHANNEL}")
    for option in ("uid", "gid"):
        value = getattr(args, option)
        if value is not None and not 0 <= value <= MAX_ID:
            problems.append(f"--{option} {value}: expected 0 to {MAX_ID}")
    return problems


def usage(command_name: str, problems: Sequence[str]) -> int:
    """Print one line per usage problem, then EXIT_USAGE."""
    for problem in problems:
        print(f"imexd {command_name}: {problem}", file=sys.stderr)
    return EXIT_USAGE


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run(main)`, asyncio imported only once a command runs: `--version`,
    `--help` and a usage error do not pay for it."""
    import asyncio  # noqa: PLC0415 - lazy: see the docstring

    return asyncio.run(main)
