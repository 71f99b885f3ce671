"""`imexd check` and `imexd status`: tiny clients of the local agent's HTTP endpoint.

`check` is an exec probe (Kubernetes, systemd, cron): exit 0 when the agent answers
200, else 1 with the reason on one line, so that the probe's recorded output says what
is wrong. `status` shows a person the agent's HealthReport. Both use only the standard
library's urllib: an exec probe runs every few seconds and must start fast, and must
not depend on the event loop stack that the agent itself may be wedged in.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any, Final, NamedTuple, TextIO

import msgspec

from imexd import messages
from imexd.errors import ConfigError
from imexd.messages import ChannelsView, DaemonInfo, HealthReport

USER_AGENT: Final = "imexd-probe"
BODY_MAX: Final = 1024 * 1024
"""Bytes of a response read at most: an endpoint that sends more is not ours."""
_WILDCARDS: Final = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class UnreachableError(Exception):
    """The agent did not answer at all (refused, timed out, not HTTP)."""


class Answer(NamedTuple):
    status: int
    body: bytes


def base_url(url: str | None, config: str | None) -> str:
    """`url` (`--url`), or the URL the agent listens on according to `[health] listen`
    in the settings file `config`."""
    if url:
        url = url.rstrip("/")
        return url if "://" in url else f"http://{url}"
    from imexd.settings import load_settings, parse_listen  # noqa: PLC0415 - only without --url

    listen = load_settings(config).health.listen
    host, port = parse_listen(listen)
    if port == 0:
        raise ConfigError([f"health.listen = {listen!r}: port 0 is any free port, so pass --url"])
    host = _WILDCARDS.get(host, host)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def fetch(url: str, timeout: float) -> Answer:
    """GET `url`; any HTTP status is an Answer, anything else is UnreachableError."""
    if not url.startswith(("http://", "https://")):
        raise UnreachableError(f"not an http URL: {url}")
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})  # noqa: S310
    try:
        # The agent is local: a proxy from the environment (HTTP_PROXY) must not apply.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=timeout) as resp:
            return Answer(resp.status, resp.read(BODY_MAX))
    except urllib.error.HTTPError as exc:
        with exc:
            return Answer(exc.code, exc.read(BODY_MAX))
    except TimeoutError as exc:
        raise UnreachableError(f"no answer within {timeout:g} s") from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise UnreachableError(f"no answer within {timeout:g} s") from exc
        raise UnreachableError(_why(exc.reason)) from exc
    except (OSError, ValueError) as exc:
        raise UnreachableError(_why(exc)) from exc


def _why(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def _decode(body: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def check(base: str, *, live: bool, timeout: float) -> int:
    """`imexd check`: 0 when the agent at `base` is ready (or live), else 1 and why on one
    line."""
    path, word = ("/healthz", "live") if live else ("/readyz", "ready")
    try:
        answer = fetch(base + path, timeout)
    except UnreachableError as exc:
        print(_one_line(f"agent unreachable at {base}: {exc}"))
        return 1
    if answer.status == 200:
        print(word)
        return 0
    body = _decode(answer.body) or {}
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason:
        reason = f"HTTP {answer.status} from {base + path}"
    print(_one_line(f"not {word}: {reason}"))
    return 1


def status(base: str, *, as_json: bool, timeout: float) -> int:
    """`imexd status`: print the agent's HealthReport for a person (or as JSON); 1 if
    unreachable."""
    try:
        answer = fetch(base + "/status", timeout)
    except UnreachableError as exc:
        print(_one_line(f"agent unreachable at {base}: {exc}"), file=sys.stderr)
        return 1
    if answer.status != 200:
        print(f"agent at {base} answered HTTP {answer.status} for /status", file=sys.stderr)
        return 1
    try:
        rep = msgspec.json.decode(answer.body, type=HealthReport)
    except msgspec.DecodeError as exc:
        print(f"agent at {base} sent an invalid report: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(msgspec.to_builtins(rep), indent=2))
    else:
        print_report(rep, sys.stdout)
    return 0


def print_report(rep: HealthReport, out: TextIO) -> None:
    """The report as aligned lines: who, where, the daemon, then each condition."""
    d = rep.daemon
    where = f"slot {rep.slot}" if rep.slot is not None else "no slot"
    lines = [
        ("node", f"{rep.node}" + (f" ({rep.address})" if rep.address else "")),
        (
            "domain",
            f"{rep.domain}, clique {rep.clique or '(none)'}, {where}"
            if rep.domain
            else "none (idle)",
        ),
        ("ready", "yes" if rep.ready else "no"),
        ("daemon", _daemon_line(d)),
        ("imex", d.imex_status or "-"),
    ]
    if rep.domain_view is not None:
        view = rep.domain_view
        members = ", ".join(
            f"{slot}:{v.node}={v.status}" + ("" if v.connected else " (disconnected)")
            for slot, v in sorted(view.nodes.items(), key=lambda item: int(item[0]))
        )
        lines.append(("domain state", f"{view.status}" + (f" [{members}]" if members else "")))
    else:
        up = next((c for c in rep.conditions if c.type == messages.DOMAIN_UP), None)
        if rep.domain and up is not None and up.status == "Unknown":
            lines.append(("domain state", f"UNKNOWN ({up.reason})"))
    if rep.driver:
        lines.append(("driver", rep.driver))
    if rep.channels is not None:
        lines.append(("channels", _channels_line(rep.channels)))
    lines.append(("control", _control_line(rep.control_key)))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}", file=out)
    print("conditions:", file=out)
    types = max((len(c.type) for c in rep.conditions), default=0)
    reasons = max((len(c.reason) for c in rep.conditions), default=0)
    for c in rep.conditions:
        mark = " " if c.type not in messages.READINESS_TYPES else "*"
        print(
            f" {mark}{c.type:<{types}}  {c.status:<7}  {c.reason:<{reasons}}  {c.message}",
            file=out,
        )
    print("(* = required for ready)", file=out)


def _control_line(key: str) -> str:
    """Whether the agent verifies the control plane's records, and with which key."""
    if key:
        return f"records verified with key {key}"
    return "records accepted unsigned (no control.public_key)"


def _channels_line(view: ChannelsView) -> str:
    """The driver's channels, then each workload's channel and whether it is ready."""
    count = "unknown count" if view.count is None else f"{view.count} channels"
    major = "no device major" if view.major is None else f"major {view.major}"
    parts = [f"{count}, {major}"]
    for w in view.workloads:
        state = "ready" if w.ready else (w.reason or "not ready")
        parts.append(f"{w.workload}: channel {w.channel} {state}")
    return "; ".join(parts)


def _daemon_line(d: DaemonInfo) -> str:
    parts = [d.state]
    if d.pid is not None:
        parts.append(f"pid {d.pid}")
    parts.append(f"{d.restarts} restart{'s' if d.restarts != 1 else ''}")
    if d.last_exit:
        parts.append(f"last exit: {d.last_exit}")
    return ", ".join(parts)
