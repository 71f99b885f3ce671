"""Settings: defaults, the file, environment overrides and every kind of wrong value."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from imexd.cli.main import main
from imexd.errors import ConfigError
from imexd.names import is_dns1123_label, is_dns1123_subdomain
from imexd.settings import (
    iter_settings,
    load_settings,
    parse_broker_url,
    settings_from_mapping,
)
from imexd.settings_text import example_toml, reference_markdown, render_toml
from tests.support import imexd

ROOT = Path(__file__).resolve().parent.parent
BASE = {"node": {"name": "n1", "address": "127.0.0.1"}}


def problems_of(raw: Mapping[str, object], env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(raw, environ=env or {})
    return info.value.problems


def test_defaults_load_without_a_file(tmp_path: Path) -> None:
    """An absent default file gives the documented defaults."""
    settings = load_settings(None, environ={"IMEXD_NODE_NAME": "gpu-01"})
    assert settings.node.name == "gpu-01"
    assert settings.domain.max_nodes == 18
    assert settings.domain.mode == "names"
    assert settings.bus.topic_prefix == "imex/v2"
    assert settings.imex.reload_min_interval_s == 6.0
    assert settings.imex.server_port == 50000
    assert settings.health.listen == "127.0.0.1:9440"
    assert settings.config_path == Path("/run/imexd/config.cfg")
    assert settings.node.address  # auto-detected


def test_named_file_must_exist(tmp_path: Path) -> None:
    """A --config path that does not exist is an error, not silent defaults."""
    with pytest.raises(ConfigError, match="file not found"):
        load_settings(tmp_path / "missing.toml", environ={})


def test_file_values_and_env_override(tmp_path: Path) -> None:
    """The environment wins over the file and is parsed as the setting's type."""
    path = tmp_path / "imexd.toml"
    path.write_text(
        '[node]\nname = "a.b-c"\naddress = "10.0.0.1"\n'
        '[domain]\nname = "job-1"\nmax_nodes = 4\n'
        '[daemon]\nstop_timeout_s = 3\n[imex.extra]\nIMEX_WAIT_FOR_QUORUM = "NONE"\n'
    )
    env = {
        "IMEXD_DOMAIN_MAX_NODES": "8",
        "IMEXD_BUS_URL": "mqtt://a:1884, unix:///run/mqtt.sock",
        "IMEXD_DOMAIN_ASSIGNED": "no",
        "IMEXD_IMEX_ENV": '{ FOO = "bar" }',
        "IMEXD_SIM_HOSTS_FILE": "/ignored",  # the simulator's variable, not a section
    }
    s = load_settings(path, environ=env)
    assert s.node.name == "a.b-c"
    assert s.domain.max_nodes == 8
    assert s.daemon.stop_timeout_s == 3.0
    assert s.bus.url == ("mqtt://a:1884", "unix:///run/mqtt.sock")
    assert [str(b) for b in s.brokers] == ["mqtt://a:1884", "unix:///run/mqtt.sock"]
    assert dict(s.imex.extra) == {"IMEX_WAIT_FOR_QUORUM": "NONE"}
    assert dict(s.imex.env) == {"FOO": "bar"}


def test_every_wrong_key_is_reported_at_once() -> None:
    """One error lists each wrong key with its value and what was expected."""
    problems = problems_of(
        {
            "node": {"name": "Bad_Name", "naem": "x"},
            "imex": {"server_port": 70000},
            "daemon": {"stop_timeout_s": -1},
            "bus": {"url": "http://broker"},
            "domain": {"name": "a.b", "mode": "ips"},
            "nope": {},
        },
        env={"IMEXD_LOG_LEVEL": "loud"},
    )
    text = "\n".join(problems)
    assert "node.name = 'Bad_Name': expected a DNS-1123 subdomain" in text
    assert "node.naem: unknown setting" in text
    assert "imex.server_port = 70000: expected a TCP port 1..65535" in text
    assert "daemon.stop_timeout_s = -1: expected a duration in seconds > 0" in text
    assert "bus.url = 'http://broker': expected mqtt://" in text
    assert "domain.name = 'a.b': expected empty or a DNS-1123 label" in text
    assert 'domain.mode = \'ips\': expected one of "names", "addresses"' in text
    assert "[nope]: unknown section" in text
    assert "IMEXD_LOG_LEVEL = 'loud': expected one of" in text
    assert len(problems) == 9


def test_a_misspelt_section_gets_a_did_you_mean() -> None:
    """An unknown section close to a known one is named with the one it likely means,
    as a misspelt key is; one far from every section gets the list alone."""
    problems = problems_of({"bsu": {"url": "mqtt://b"}, "zzz": {}})
    assert problems[0] == (
        "[bsu]: unknown section in <settings>; expected one of node, domain, bus, imex, "
        "daemon, health, channels, control, log; did you mean [bus]?"
    )
    assert problems[1].startswith("[zzz]: unknown section")
    assert "did you mean" not in problems[1]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"domain": {"max_nodes": "18"}}, "domain.max_nodes = '18': expected an integer"),
        ({"domain": {"max_nodes": 0}}, "domain.max_nodes = 0: expected an integer 1..2048"),
        ({"domain": {"assigned": 1}}, "domain.assigned = 1: expected true or false"),
        ({"daemon": {"start_s": True}}, "daemon.start_s = True: expected a number of seconds"),
        ({"daemon": {"start_s": float("nan")}}, "expected a number of seconds"),
        ({"node": {"address": "10.0.0.300"}}, "expected empty (auto) or an IPv4/IPv6 address"),
        ({"node": {"clique": "a/b"}}, "node.clique = 'a/b': expected"),
        ({"node": {"state_dir": "var/lib"}}, "expected an absolute path"),
        ({"health": {"listen": "9440"}}, "health.listen = '9440': expected HOST:PORT"),
        ({"bus": {"topic_prefix": "imex/#"}}, "expected topic levels of letters, digits"),
        ({"bus": {"url": []}}, "expected at least one broker URL"),
        ({"bus": {"url": "mqtt://h:0"}}, "bus.url = 'mqtt://h:0'"),
        ({"imex": {"extra": {"lower": "1"}}}, "expected a table of UPPER_CASE"),
        ({"imex": {"extra": {"A": {"b": 1}}}}, "expected a table of KEY = value"),
        ({"imex": {"cmd_port": 50000}}, "imex.cmd_port = 50000: expected a port other"),
        ({"bus": {"cert_file": "/c.pem"}}, "bus.cert_file / bus.key_file"),
        ({"domain": {"assigned": True, "name": "d"}}, "expected empty when domain.assigned"),
        ({"daemon": {"backoff_initial_s": 9, "backoff_max_s": 1}}, "daemon.backoff_max_s"),
        ({"node": []}, "node = []: expected a table [node]"),
        ({"imex": {"extra": {"DAEMONIZE": 1}}}, "imex.extra.DAEMONIZE = '1': the agent owns"),
        ({"node": {"address": "127.0.0.2"}}, "is the empty-slot sentinel"),
        ({"node": {"address": "fe80::1%eth0"}}, "has a zone id"),
        ({"node": {"address": "2001:DB8::1"}}, "write '2001:db8::1'"),
        ({"node": {"address": "0.0.0.0"}}, "is unspecified"),
        ({"bus": {"protocol": "4"}}, 'bus.protocol = \'4\': expected one of "auto", "5", "3.1.1"'),
        ({"bus": {"protocol": 5}}, "bus.protocol = 5: expected a string"),
        ({"daemon": {"release_after_s": -1}}, "daemon.release_after_s = -1: expected a duration"),
        ({"domain": {"claim_stale_s": 0}}, "domain.claim_stale_s = 0: expected a duration"),
        (
            {"domain": {"settle_s": 2, "claim_stale_s": 8}},
            "domain.claim_stale_s = 8.0: expected more than 4 x domain.settle_s (8.0)",
        ),
    ],
)
def test_wrong_values_name_key_value_and_expectation(raw: dict[str, object], expected: str) -> None:
    """Each kind of wrong value gets a message naming it."""
    merged = {**BASE, **raw}
    if "node" in raw and isinstance(raw["node"], dict):
        merged["node"] = {**BASE["node"], **raw["node"]}
    assert any(expected in p for p in problems_of(merged))


def test_new_keys_default_and_load_from_file_and_environment(tmp_path: Path) -> None:
    """bus.protocol, daemon.release_after_s and domain.claim_stale_s have their documented
    defaults and are read from the file and the environment like every other key."""
    defaults = settings_from_mapping(BASE, environ={})
    assert defaults.bus.protocol == "auto"
    assert defaults.daemon.release_after_s == 300.0
    assert defaults.domain.claim_stale_s == 30.0
    path = tmp_path / "imexd.toml"
    path.write_text(
        '[node]\nname = "n1"\naddress = "127.0.0.1"\n[bus]\nprotocol = "3.1.1"\n'
        "[daemon]\nrelease_after_s = 0\n"
    )
    s = load_settings(path, environ={"IMEXD_BUS_PROTOCOL": "5", "IMEXD_DOMAIN_CLAIM_STALE_S": "12"})
    assert s.bus.protocol == "5"
    assert s.daemon.release_after_s == 0.0
    assert s.domain.claim_stale_s == 12.0
    kinds = {(i.section, i.key): i.kind for i in iter_settings()}
    assert kinds[("bus", "protocol")] == "str"


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    """A file that is not TOML is one clear error naming the file."""
    path = tmp_path / "bad.toml"
    path.write_text("[node\nname=")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_settings(path, environ={})


def test_broker_urls() -> None:
    """Broker URLs get default ports per scheme; other schemes are refused."""
    assert str(parse_broker_url("mqtt://broker")) == "mqtt://broker:1883"
    assert str(parse_broker_url("mqtts://broker")) == "mqtts://broker:8883"
    assert str(parse_broker_url("mqtt://[::1]:1999")) == "mqtt://[::1]:1999"
    assert parse_broker_url("unix:///run/m.sock").path == "/run/m.sock"
    for bad in ("ws://h", "mqtt://", "unix://rel/path", "mqtt://u@h", "mqtt://h/x", "mqtt://h:x"):
        with pytest.raises(ValueError):
            parse_broker_url(bad)


def test_shipped_example_lists_every_key_and_loads() -> None:
    """config/imexd.toml is the generated example, and it loads as the defaults."""
    shipped = (ROOT / "config" / "imexd.toml").read_text()
    assert shipped == example_toml()
    for info in iter_settings():
        assert f"{info.key} = " in shipped, info.key
    settings = load_settings(ROOT / "config" / "imexd.toml", environ={"IMEXD_NODE_NAME": "x"})
    assert settings.domain.max_nodes == 18


def test_configuration_doc_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/configuration.md carries the reference `imexd config --reference` prints, so no
    setting is missing."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert main(["config", "--reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == reference_markdown()
    assert printed in doc
    for info in iter_settings():
        assert info.env in doc


def test_run_exits_2_on_invalid_config(tmp_path: Path) -> None:
    """`imexd run` with a wrong key exits 2 and names the key on stderr."""
    path = tmp_path / "imexd.toml"
    path.write_text('[imex]\nserver_port = 0\n[node]\nname = "n1"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "imexd", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "imex.server_port = 0: expected a TCP port" in proc.stderr


label = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?\Z")


@given(st.lists(label, min_size=1, max_size=4).map(".".join))
def test_valid_node_names_are_accepted(name: str) -> None:
    """Every DNS-1123 subdomain is a valid node name."""
    settings = settings_from_mapping({"node": {"name": name, "address": "127.0.0.1"}}, environ={})
    assert settings.node.name == name


@given(st.text(max_size=30))
def test_node_name_validation_matches_the_rule(name: str) -> None:
    """A node name is accepted exactly when it is a DNS-1123 subdomain, else named."""
    raw = {"node": {"name": name, "address": "127.0.0.1"}}
    if is_dns1123_subdomain(name):
        assert settings_from_mapping(raw, environ={}).node.name == name
    else:
        assert any(p.startswith("node.name = ") for p in problems_of(raw))


@given(st.text(max_size=70))
def test_domain_name_validation_matches_the_rule(name: str) -> None:
    """A domain name is accepted exactly when empty or a DNS-1123 label."""
    raw = {**BASE, "domain": {"name": name}}
    if name == "" or is_dns1123_label(name):
        assert settings_from_mapping(raw, environ={}).domain.name == name
    else:
        assert any(p.startswith("domain.name = ") for p in problems_of(raw))


@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_ports_in_range_only(port: int) -> None:
    """Ports are accepted exactly in 1..65535."""
    raw = {**BASE, "imex": {"server_port": port, "cmd_port": 1 if port != 1 else 2}}
    if 1 <= port <= 65535:
        assert settings_from_mapping(raw, environ={}).imex.server_port == port
    else:
        assert any(p.startswith("imex.server_port = ") for p in problems_of(raw))


@given(
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True).filter(
            lambda f: not math.isfinite(f) or abs(f) < 1e300  # 4 x settle_s must be finite
        ),
        st.integers(-1000, 1000),
        st.text(max_size=5),
        st.booleans(),
        st.none(),
    )
)
def test_durations_are_non_negative_numbers(value: object) -> None:
    """A duration is any finite number >= 0; anything else is named with its key."""
    if value is None:
        return  # TOML has no null
    finite = isinstance(value, int | float) and math.isfinite(value)
    stale = 8 * value + 1 if finite else 30  # type: ignore[operator]
    raw = {**BASE, "domain": {"settle_s": value, "claim_stale_s": stale}}
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )
    if ok:
        assert settings_from_mapping(raw, environ={}).domain.settle_s == float(value)  # type: ignore[arg-type]
    else:
        assert any(p.startswith("domain.settle_s = ") for p in problems_of(raw))


def test_cli_config_prints_effective_values(tmp_path: Path) -> None:
    """`imexd config` shows the file and environment merged."""
    proc = subprocess.run(
        [sys.executable, "-m", "imexd", "config", "--config", str(ROOT / "config/imexd.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        # No NVLink here: without a clique the node needs no nvidia-imex on PATH.
        env={"IMEXD_NODE_NAME": "gpu-7", "IMEXD_NODE_CLIQUE": "", "PATH": "/usr/bin:/bin"},
    )
    assert "node.name = 'gpu-7'" in proc.stdout
    assert "domain.max_nodes = 18" in proc.stdout


def test_render_toml_is_read_back_by_tomllib() -> None:
    """Generated settings files parse back to the mappings they came from, sub-tables included."""
    text = render_toml(
        {"bus": {"url": ["mqtt://127.0.0.1:1"], "will_delay_s": 2.0}, "imex": {"env": {"A": "b"}}}
    )
    assert tomllib.loads(text) == {
        "bus": {"url": ["mqtt://127.0.0.1:1"], "will_delay_s": 2.0},
        "imex": {"env": {"A": "b"}},
    }


def test_a_stop_timeout_the_unit_would_cut_is_refused() -> None:
    """[daemon] stop_timeout_s + the agent's shutdown margin must fit in the unit's
    TimeoutStopSec (service_stop_timeout_s): 40 s is refused with both keys and the
    drop-in named; raising both together is accepted."""
    problems = problems_of({**BASE, "daemon": {"stop_timeout_s": 40}})
    assert len(problems) == 1
    text = problems[0]
    assert text.startswith("daemon.stop_timeout_s = 40.0")
    assert "daemon.service_stop_timeout_s" in text
    assert "TimeoutStopSec=30" in text
    assert "systemctl edit imexd" in text
    assert "terminationGracePeriodSeconds" in text
    raised = {**BASE, "daemon": {"stop_timeout_s": 40, "service_stop_timeout_s": 60}}
    assert settings_from_mapping(raised, environ={}).daemon.stop_timeout_s == 40.0
    assert problems_of({**BASE, "daemon": {"stop_timeout_s": 25}})  # 25 + 5 leaves no margin
    assert settings_from_mapping({**BASE, "daemon": {"stop_timeout_s": 24}}, environ={})


def _node_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "imexd.toml"
    path.write_text(
        '[node]\nname = "n1"\naddress = "127.0.0.1"\nclique = "c.0"\n'
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[imex]\nbinary = "{sys.executable}"\nctl = "{sys.executable}"\n'
        f'run_dir = "{tmp_path / "run"}"\nhosts_file = "{tmp_path / "hosts"}"\n' + extra
    )
    return path


def test_missing_bus_files_are_named_by_config_run_and_the_control_plane(tmp_path: Path) -> None:
    """A [bus] TLS or password file that does not exist is one problem naming the key and
    the path: `imexd config` and `imexd run` exit 2, and so does a control-plane command,
    before any broker is tried."""
    missing = tmp_path / "bus" / "ca.crt"
    key = tmp_path / "node.key"
    key.write_text("key")
    path = _node_file(
        tmp_path,
        f'[bus]\nurl = "mqtts://127.0.0.1:1"\nca_file = "{missing}"\n'
        f'cert_file = "{tmp_path}"\nkey_file = "{key}"\n',
    )
    for args in (["config"], ["run"], ["domain", "list"]):
        proc = imexd(*args, "--config", str(path))
        assert proc.returncode == 2, (args, proc.stderr)
        assert f"bus.ca_file = '{missing}': cannot read it: No such file or directory" in (
            proc.stderr
        )
        assert f"bus.cert_file = '{tmp_path}': cannot read it: Is a directory" in proc.stderr
        assert "key_file" not in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_missing_imex_binary_fails_run_at_once(tmp_path: Path) -> None:
    """`imexd run` exits 2 naming a missing [imex] binary or ctl instead of retrying;
    `imexd config` reports it the same way; a node without NVLink (clique "") needs none."""
    path = _node_file(tmp_path)
    text = path.read_text().replace(f'binary = "{sys.executable}"', 'binary = "nvidia-imex-x"')
    path.write_text(text.replace(f'ctl = "{sys.executable}"', f'ctl = "{tmp_path}/ctl"'))
    for command in ("run", "config"):
        started = time.monotonic()
        proc = imexd(command, "--config", str(path), env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 2, proc.stderr
        assert time.monotonic() - started < 30
        assert "imex.binary = 'nvidia-imex-x': not found on PATH (/usr/bin:/bin)" in proc.stderr
        assert f"imex.ctl = '{tmp_path}/ctl': no such file" in proc.stderr
    path.write_text(path.read_text().replace('clique = "c.0"', 'clique = ""'))
    assert imexd("config", "--config", str(path)).returncode == 0


def test_config_reads_an_env_file_as_systemd_does(tmp_path: Path) -> None:
    """`imexd config --env-file` applies the file's IMEXD_* variables (not the shell's)
    over the config file, and a wrong value names the env file's line."""
    path = _node_file(tmp_path)
    env_file = tmp_path / "imexd.env"
    env_file.write_text("# per node\nIMEXD_DOMAIN_NAME=job-7\n\nIMEXD_NODE_NAME = 'gpu-9'\n")
    proc = imexd(
        "config", "--config", str(path), "--env-file", str(env_file),
        env={"IMEXD_DOMAIN_MAX_NODES": "0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "domain.name = 'job-7'" in proc.stdout
    assert "node.name = 'gpu-9'" in proc.stdout
    env_file.write_text(
        "# the node's address on the network IMEX should use\n"
        "IMEXD_NODE_ADDRESS=10.40.7.11    # the old install.md example\n"
    )
    proc = imexd("config", "--config", str(path), "--env-file", str(env_file))
    assert proc.returncode == 2
    assert f"{env_file}:2: IMEXD_NODE_ADDRESS = '10.40.7.11    # the old install.md" in proc.stderr
    assert f"warning: {env_file}:2: the value of IMEXD_NODE_ADDRESS" in proc.stderr
    env_file.write_text("export IMEXD_NODE_NAME=x\n")
    proc = imexd("config", "--config", str(path), "--env-file", str(env_file))
    assert proc.returncode == 2
    assert f"{env_file}:1: 'export IMEXD_NODE_NAME': not a variable name" in proc.stderr


def test_the_install_docs_env_example_validates(tmp_path: Path) -> None:
    """The env-file block of docs/install.md, as an operator copies it, passes; the only
    warning is that its address is not this host's (it names the example's node)."""
    doc = (ROOT / "docs" / "install.md").read_text()
    marker = "and in `/etc/imexd/imexd.env` on that node"
    block = doc[doc.index(marker) :].split("```sh\n", 1)[1].split("```", 1)[0]
    env_file = tmp_path / "imexd.env"
    env_file.write_text(block)
    proc = imexd("config", "--config", str(_node_file(tmp_path)), "--env-file", str(env_file))
    assert proc.returncode == 0, proc.stderr
    assert "node.address = '10.40.7.11'" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert [w for w in warnings if "not an address of this host" not in w] == []
