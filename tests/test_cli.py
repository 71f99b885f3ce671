"""The command line: exit codes and one-line errors instead of tracebacks."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from imexd.cli.main import build_parser, main
from imexd.demo.brokers import free_port
from imexd.messages import ChannelsView, encode
from imexd.topics import Topics
from tests.brokers import Mosquitto
from tests.reports import report as health_report
from tests.support import imexd
from tests.test_control import put


def test_a_fatal_start_error_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """An agent whose health port is taken prints one line, before any log line, that
    names the address and the setting to change, and exits 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "imexd.toml"
        config.write_text(
            f'[node]\nname = "n1"\naddress = "127.0.0.1"\nclique = ""\n'
            f'state_dir = "{tmp_path / "state"}"\n'
            f'[bus]\nurl = "mqtt://127.0.0.1:{free_port()}"\n'
            f'[imex]\nrun_dir = "{tmp_path / "run"}"\nhosts_file = "{tmp_path / "hosts"}"\n'
            f'[health]\nlisten = "127.0.0.1:{port}"\n'
        )
        proc = imexd("run", "--config", str(config))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"imexd: cannot listen on 127.0.0.1:{port}: Address already in use: another process "
        f"holds the port (a second agent?): stop it, or set [health] listen "
        f"(IMEXD_HEALTH_LISTEN) to a free HOST:PORT"
    ]


def _daemon_config(tmp_path: Path, **imex: str) -> Path:
    """A settings file of a node that runs the simulated daemon, `imex` keys laid over."""
    bin_dir = Path(sys.executable).parent
    values = {
        "run_dir": str(tmp_path / "run"),
        "hosts_file": str(tmp_path / "hosts"),
        "binary": str(bin_dir / "imexd-sim-daemon"),
        "ctl": str(bin_dir / "imexd-sim-ctl"),
    } | imex
    config = tmp_path / "imexd.toml"
    config.write_text(
        f'[node]\nname = "n1"\naddress = "127.0.0.1"\nclique = "c1"\n'
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[bus]\nurl = "mqtt://127.0.0.1:{free_port()}"\n'
        "[imex]\n" + "".join(f'{key} = "{value}"\n' for key, value in values.items())
    )
    return config


def test_a_run_dir_that_cannot_be_created_is_a_configuration_error(tmp_path: Path) -> None:
    """`imexd run` and `imexd config` refuse an `[imex] run_dir` below a regular file
    (exit 2, nothing started), naming the key, the file in the way and why."""
    (tmp_path / "file").write_text("")
    config = _daemon_config(tmp_path, run_dir=str(tmp_path / "file" / "run"))
    expected = (
        f"imex.run_dir = '{tmp_path / 'file' / 'run'}': cannot create it: "
        f"{tmp_path / 'file'} is not a directory"
    )
    for command in ("config", "run"):
        proc = imexd(command, "--config", str(config))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == ["imexd: invalid configuration:", f"  {expected}"]


def test_config_warns_of_a_node_address_not_on_this_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`imexd config` says when `[node] address` is no address of this host (the IMEX
    daemon could not bind it, as `imexd run` logs too), and still exits 0: an interface
    may come up later. Any 127.0.0.0/8 address is this host's on Linux."""
    held = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    elsewhere = next(a for a in ("203.0.113.77", "198.51.100.77", "192.0.2.77") if a not in held)
    config = _daemon_config(tmp_path)
    env = tmp_path / "imexd.env"
    env.write_text(f"IMEXD_NODE_ADDRESS={elsewhere}\n")
    assert main(["config", "-c", str(config), "--env-file", str(env)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(
        f"imexd config: warning: node.address = '{elsewhere}': not an address of this host "
    ), err
    assert "the IMEX daemon cannot bind it" in err
    env.write_text("IMEXD_NODE_ADDRESS=127.0.0.9\n")
    assert main(["config", "-c", str(config), "--env-file", str(env)]) == 0
    assert capsys.readouterr().err == ""


def test_the_agents_command_lines_are_read_without_argparse(tmp_path: Path) -> None:
    """`imexd run` with no option, `--config FILE`, `-c FILE` or `--config=FILE` reads
    that file as argparse would, without loading argparse (the agent would hold it for
    its whole life); any other form, such as an abbreviated option, goes to argparse."""
    config = tmp_path / "imexd.toml"
    config.write_text("[nod]\n")
    script = (
        "import sys\n"
        "from imexd.cli.main import main\n"
        "for argv in sys.argv[1:]:\n"
        "    code = main(argv.split())\n"
        "    print(code, 'argparse' in sys.modules, flush=True)\n"
    )
    forms = [f"run --config {config}", f"run -c {config}", f"run --config={config}"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *forms, f"run --conf {config}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout.splitlines() == ["2 False"] * len(forms) + ["2 True"], proc.stderr
    assert proc.stderr.count(f"[nod]: unknown section in {config}") == len(forms) + 1
    env = os.environ | {"IMEXD_NODE_NAME": "Not A Name"}
    proc = subprocess.run(
        [sys.executable, "-c", script, "run"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert proc.stdout.splitlines() == ["2 False"], proc.stderr
    assert "IMEXD_NODE_NAME = 'Not A Name'" in proc.stderr


def test_usage_errors_exit_2() -> None:
    """An unknown subcommand is a usage error (argparse's exit 2)."""
    proc = imexd("no-such-command")
    assert proc.returncode == 2


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `imexd ARGV` in process, expect a usage error (exit 2); its stderr."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["check", "status", "discover"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """`--timeout -1` (or 0, or nan) is a usage error naming the option, not a connection
    error after trying."""
    for bad in ("-1", "0", "nan"):
        err = _usage_error(capsys, *command.split(), "--timeout", bad)
        assert "--timeout" in err
        assert "expected seconds > 0" in err


def test_an_unknown_option_shows_its_own_commands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`status --bogus` prints the usage of `imexd status`, not the top-level one."""
    err = _usage_error(capsys, "status", "--bogus")
    assert err.startswith("usage: imexd status"), err
    assert "unrecognized arguments: --bogus" in err
    err = _usage_error(capsys, "domain", "list", "--bogus")
    assert err.startswith("usage: imexd domain list"), err


def test_a_mistyped_command_gets_a_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    """A command name close to a real one is suggested (difflib)."""
    assert "did you mean 'status'?" in _usage_error(capsys, "stauts")
    assert "did you mean 'create'?" in _usage_error(capsys, "domain", "craete")
    assert "did you mean" not in _usage_error(capsys, "zzzzzz")


def test_a_closed_pipe_is_not_a_traceback() -> None:
    """Output whose reader went away (`| head`) ends quietly instead of a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "imexd", "config", "--example"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert "Traceback" not in proc.stderr


def test_workload_help_states_the_defaults_and_the_exit_codes() -> None:
    """Each workload action's help gives every option's default and its exit codes."""
    proc = imexd("workload", "create", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for phrase in (
        "(default 0660)",
        "(default 60; 0: do not wait)",
        "the lowest free channel from 1",
        "3 no free channel",
    ):
        assert phrase in text, phrase


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["workload", "create", "W1", "--domain", "d1"], "workload name 'W1' is not a DNS-1123"),
        (["workload", "create", "w1", "--domain", "d_1"], "domain name 'd_1' is not"),
        (["workload", "create", "w1", "--domain", "d1", "--mode", "0999"], "expected octal"),
        (["workload", "create", "w1", "--domain", "d1", "--mode", "01777"], "0000 to 0777"),
        (["workload", "create", "w1", "--domain", "d1", "--uid", "-1"], "--uid -1: expected 0"),
        (["workload", "create", "w1", "--domain", "d1", "--channel", "1048576"], "expected 0 to"),
        (["workload", "create", "w1", "--domain", "d1", "--nodes", "n1,n1"], "more than once"),
        (["workload", "create", "w1", "--domain", "d1", "--wait", "-1"], "expected seconds >= 0"),
        (["workload", "create", "w1"], "--domain"),
        (["workload", "status", "w-"], "is not a DNS-1123 label"),
        (["workload", "env", "w1", "--domain", "D1"], "domain name 'D1' is not"),
        (["workload", "list", "--domain", "d.1"], "domain name 'd.1' is not"),
        (["domain", "create", "d1", "--uid", "5"], "--uid only go with --channel"),
        (["domain", "create", "d1", "--channel", "x"], "invalid integer value: 'x'"),
    ],
)
def test_workload_usage_errors_exit_2_before_any_broker(args: list[str], message: str) -> None:
    """Bad names, modes, ids and channels are refused with exit 2 and a message naming the
    value, before a broker is contacted (none listens on the configured port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    env["IMEXD_BUS_URL"] = f"mqtt://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "imexd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_workload_create_exits_3_when_no_channel_is_free(broker: Mosquitto) -> None:
    """Through the console script: a domain whose nodes offer 2 channels has one for
    workloads; the second create exits 3 saying so."""
    report = msgspec.structs.replace(
        health_report("n1", 0, {0: "n1"}, at=time.time()),
        channels=ChannelsView(count=2, major=242),
    )
    asyncio.run(put(broker, {Topics("imex/v2").health("d1", "n1"): encode(report)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    env["IMEXD_BUS_URL"] = broker.url
    base = [sys.executable, "-m", "imexd", "workload", "create", "--domain", "d1"]
    runs = [
        subprocess.run(
            [*base, name, "--wait", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
        for name in ("w1", "w2")
    ]
    assert runs[0].returncode == 0, runs[0].stderr
    assert "workload w1 in d1: created on channel 1" in runs[0].stdout
    assert runs[1].returncode == 3
    assert "no free channel in d1: its nodes offer 2 channels" in runs[1].stderr


def _leaf_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand that runs something, e.g. ("imexd domain create", its parser)."""
    found: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found.append((name, parser))
        for action in subs:
            for child, sub in action.choices.items():
                walk(f"{name} {child}", sub)

    walk("imexd", build_parser())
    return found


def test_every_option_has_help_with_its_default_and_every_command_its_exit_codes() -> None:
    """Walking the parser: each argument of each subcommand has help text, an option
    with a default names it, and each subcommand's help ends with its exit codes."""
    leaves = _leaf_parsers()
    assert len(leaves) >= 19
    for name, parser in leaves:
        assert (parser.epilog or "").startswith("exit codes: 0 "), name
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label}: no help"
            assert action.help != argparse.SUPPRESS, label
            shown = parser._get_formatter()._expand_help(action)
            if action.option_strings and action.default not in (None, False):
                assert "default" in shown, f"{label}: the help does not give the default"
                assert "%(" not in shown, label


def test_domain_status_help_describes_wait_and_json() -> None:
    """`domain status --help` says --wait waits for UP and returns at once when it is, or
    when the domain cannot be UP, and --json has help; the defaults are shown."""
    proc = imexd("domain", "status", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "wait up to this long for the domain to be UP, returning the moment it is" in text
    assert "(default 2; 0: judge the snapshot only)" in text
    assert "Without a spec and without --nodes it cannot be UP: the snapshot is judged" in text
    assert "--json print the judgement as JSON" in text
    assert "exit codes: 0 the domain is UP; 1 not UP" in text


HEAVY = (
    "asyncio",
    "msgspec",
    "psutil",
    "structlog",
    "aiohttp",
    "aiomqtt",
    "rich",
    "pygments",
    "prometheus_client",
    "http.client",
    "email",
)
"""What a control command's start must not import before it runs (--version, --help, a
usage error): each costs milliseconds of every prolog's start."""


def _imported_after(code: str, env: dict[str, str] | None = None) -> list[str]:
    probe = (
        "import sys, contextlib\n"
        f"with contextlib.suppress(SystemExit):\n    {code}\n"
        f"print('\\n' + ','.join(m for m in {HEAVY!r} if sys.modules.get(m) is not None))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=None if env is None else {**os.environ, **env},
    )
    return [m for m in done.stdout.splitlines()[-1].split(",") if m]


def test_version_and_usage_errors_import_nothing_heavy() -> None:
    """`imexd --version` and a usage error are answered by argparse alone: asyncio, msgspec,
    psutil and the rest are imported only by the command that runs."""
    assert _imported_after("__import__('imexd.cli.main').cli.main.main(['--version'])") == []
    usage = "__import__('imexd.cli.main').cli.main.main(['domain', 'create', 'D', '--wait', '-1'])"
    assert _imported_after(usage) == []


def test_a_control_command_loads_no_logging_stack() -> None:
    """A control command that runs (here against a port where nothing listens: exit 1)
    connects through imexd.bus.mqtt only: it loads neither the agent's link nor structlog,
    nor the rich and pygments that structlog pulls in where rich is installed (seen when
    the bus became a package whose __init__ imported the link: 0.13 s of every prolog's
    two commands), nor psutil (the settings' default node address), nor the http.client
    and email that paho's urllib.request import brings."""
    code = "__import__('imexd.cli.main').cli.main.main(['workload', 'list'])"
    imported = _imported_after(code, env={"IMEXD_BUS_URL": "mqtt://127.0.0.1:9"})
    assert "msgspec" in imported, "the command did not run"
    assert [m for m in imported if m in ("structlog", "rich", "pygments", "aiohttp")] == []
    assert "psutil" not in imported, "the control plane has no node address to look up"
    assert [m for m in imported if m in ("http.client", "email")] == [], "paho's proxy lookup"


def test_the_agent_imports_no_rich_and_no_aiohttp() -> None:
    """`imexd run` keeps rich and pygments (pulled in by structlog where rich is installed),
    aiohttp (its HTTP endpoint is imexd.health.http's own), prometheus_client (its text
    format is imexd.health.exposition's) and the http.client and email that paho's
    urllib.request import brings out of the agent's process; it has imported the agent's
    modules when it reaches the settings check here (exit 2)."""
    code = (
        "__import__('imexd.cli.main').cli.main.main(['run', '--config', '/nonexistent/imexd.toml'])"
    )
    imported = _imported_after(code)
    assert "structlog" in imported
    assert "aiomqtt" in imported
    heavy = ("rich", "pygments", "aiohttp", "prometheus_client", "http.client", "email")
    assert [m for m in imported if m in heavy] == []


def test_a_module_imported_lazily_loads_at_its_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands' stand-in for urllib.request: importing it loads nothing, using it loads
    the real module, and every attribute is the real one's."""
    import importlib

    from imexd.cli.deferred import import_lazily

    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    import_lazily("colorsys")
    stand_in = sys.modules["colorsys"]
    colorsys = importlib.import_module("colorsys")
    assert colorsys is stand_in
    assert "rgb_to_hsv" not in vars(stand_in)  # not loaded by its import
    assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert sys.modules["colorsys"] is not stand_in  # the real one took its place
    import_lazily("colorsys")  # already loaded: left alone
    assert sys.modules["colorsys"].rgb_to_hsv is colorsys.rgb_to_hsv


def test_the_parsers_copies_of_constants_match() -> None:
    """imexd.cli.args keeps its own copies so that parsing imports neither module."""
    from imexd import messages, settings
    from imexd.cli import args as cli_args

    assert cli_args.MAX_CHANNEL == messages.MAX_CHANNEL
    assert cli_args.DEFAULT_CONFIG_PATH == settings.DEFAULT_CONFIG_PATH


def test_an_env_files_misspelt_setting_is_one_problem_not_also_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """IMEXD_DOMAIN_MAXNODES is an unknown setting of [domain] (exit 2, with a
    suggestion), not also "not a setting; imexd ignores it". A name of no section
    (IMEXD_FOO) is the only kind imexd ignores."""
    (tmp_path / "imexd.toml").write_text("")
    env = tmp_path / "imexd.env"
    env.write_text("IMEXD_DOMAIN_MAXNODES=4\nIMEXD_FOO=1\n")
    code = main(["config", "-c", str(tmp_path / "imexd.toml"), "--env-file", str(env)])
    err = capsys.readouterr().err
    assert code == 2
    assert "IMEXD_DOMAIN_MAXNODES: unknown setting domain.maxnodes" in err
    assert "did you mean IMEXD_DOMAIN_MAX_NODES?" in err
    assert "IMEXD_DOMAIN_MAXNODES: not a setting" not in err
    assert "IMEXD_FOO: not a setting" in err


def test_a_duplicate_toml_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tomllib says only "Cannot overwrite a value (at line 3, column 11)": the key is
    named too."""
    config = tmp_path / "imexd.toml"
    config.write_text('[node]\nname = "a"\nname = "b"\n')
    assert main(["config", "-c", str(config)]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err
    assert "duplicate key 'name'" in err, err
