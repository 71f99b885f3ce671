"""The demo's simulated GPU nodes: their folders and settings, their agent processes, and
the sweep that finds (and ends) whatever the demo started.

Each node is `imexd run` exactly as shipped, with a simulated IMEX daemon on its own
loopback address, the fast timings (timings.py), its own hosts file and a simulated
driver whose channel devices live in the node's folder (`fake_driver`, with
`[channels] simulate` in the demo); the scenario only starts, signals and reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import psutil

from imexd.demo.brokers import KILL_WAIT_S, free_port
from imexd.demo.screen import Row
from imexd.demo.timings import SIM_RELOAD_WINDOW_S, with_fast
from imexd.messages import HealthReport
from imexd.process import python_module
from imexd.settings_text import render_toml

DOMAIN: Final = "demo"
"""The one static domain every simulated node joins."""
CLIQUE: Final = "sim.0"
"""The simulated NVLink partition: all nodes share it, as the GPUs of one NVL72 do."""
AGENT_STOP_TIMEOUT_S: Final = 20.0
"""An agent leaves within stop_timeout_s + 5 s; this adds room for a loaded machine."""
CHANNEL_MAJOR: Final = 242
"""The `nvidia-caps-imex-channels` major of the fake /proc/devices of every node."""
CHANNEL_COUNT: Final = 2048
"""The ImexChannelCount of the fake driver parameters of every node."""


# Small pieces of plumbing.


def _tool(name: str, module: str, folder: Path) -> str:
    """The simulator's console script, or a wrapper that runs its module.

    The agent recognises either form as an IMEX daemon (and adopts it after a restart).
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    wrapper = folder / name
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -P -m {module} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def demo_processes(folder: Path, *, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """Every process whose command line names the demo's folder: agents, daemons, probes,
    the embedded Mosquitto. Nothing else on the machine is ever touched."""
    needle, skip = str(folder), {os.getpid(), *exclude}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"], ad_value=None):
        info = proc.info
        if info["pid"] in skip or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(needle in str(arg) for arg in info["cmdline"] or ()):
            found.append(proc)
    return found


async def end_processes(procs: Sequence[psutil.Process], grace_s: float = KILL_WAIT_S) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace_s` seconds."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = await asyncio.to_thread(psutil.wait_procs, procs, grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    await asyncio.to_thread(psutil.wait_procs, alive, grace_s)


def fake_driver(
    folder: Path,
    *,
    major: int | None = CHANNEL_MAJOR,
    count: int = CHANNEL_COUNT,
    simulate: bool = False,
) -> dict[str, object]:
    """Write a fake /proc/devices and NVIDIA driver parameters under `folder`, and return
    the `[channels]` settings that point an agent at them and at channel folders under
    `folder`: a simulated node makes its channel devices there, never in /dev. `major`
    None: the driver lists no channel device. `simulate`: `[channels] simulate`, so that
    an agent without CAP_MKNOD makes stand-in files (docs/channels.md); without it such
    an agent fails MknodFailed, as on a real node."""
    devices = folder / "proc-devices"
    params = folder / "driver-params"
    imex = "" if major is None else f"{major} nvidia-caps-imex-channels\n"
    devices.write_text(f"Character devices:\n  1 mem\n195 nvidia\n{imex}\nBlock devices:\n  8 sd\n")
    params.write_text(f"ImexChannelCount: {count}\nCreateImexChannel0: 0\n")
    return {
        "dev_dir": str(folder / "dev" / "nvidia-caps-imex-channels"),
        "cdi_dir": str(folder / "cdi"),
        "env_dir": str(folder / "workloads"),
        "proc_devices": str(devices),
        "driver_params": str(params),
        "simulate": simulate,
    }


def node_folder(
    folder: Path, *, name: str, address: str, health_listen: str
) -> dict[str, dict[str, Any]]:
    """Lay out a simulated node in `folder` and return the settings that point its agent
    there: `[node]` name, address and state folder; `[imex]` run folder and hosts file,
    which the simulated daemon resolves names through alone (IMEXD_SIM_HOSTS_FILE);
    `[health]` listen; `[channels]` on a fake driver (`fake_driver`).

    The demo, tests/cluster.py and the benchmarks lay out every simulated node this way
    and add their own clique, domain, broker, simulator and timings."""
    folder.mkdir(parents=True, exist_ok=True)
    hosts = folder / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    return {
        "node": {"name": name, "address": address, "state_dir": str(folder / "state")},
        "imex": {
            "run_dir": str(folder / "run"),
            "hosts_file": str(hosts),
            "env": {"IMEXD_SIM_HOSTS_FILE": str(hosts)},
        },
        "health": {"listen": health_listen},
        "channels": fake_driver(folder),
    }


# Nodes.


class DemoNode:
    """One simulated GPU node: its folder, its agent process and its last `/status`."""

    def __init__(
        self,
        *,
        name: str,
        address: str,
        folder: Path,
        settings: Mapping[str, Mapping[str, object]],
    ) -> None:
        self.name = name
        self.address = address
        self.folder = folder
        self.config_path = folder / "imexd.toml"
        self.log_path = folder / "agent.log"
        self.health_port = free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.agent = "starting"
        """starting, up, down (killed by the demo), leaving, left, exited."""
        self.report: HealthReport | None = None
        """Its agent's last `/status`; None while the agent does not answer."""
        self.orphan_pid: int | None = None
        self.stopped = False
        """The agent left cleanly and no process of the node is left (the demo checked)."""
        folder.mkdir(parents=True)
        own = node_folder(
            folder, name=name, address=address, health_listen=f"127.0.0.1:{self.health_port}"
        )
        own["imex"]["env"]["IMEXD_SIM_RELOAD_WINDOW_S"] = SIM_RELOAD_WINDOW_S
        own["channels"]["simulate"] = True  # no root needed: stand-ins where no CAP_MKNOD
        self.channels: Mapping[str, Any] = own["channels"]
        """The node's `[channels]` settings: where its agent makes the workloads' files."""
        sections = {k: dict(v) for k, v in settings.items()}
        for section, values in own.items():
            sections[section] = sections.get(section, {}) | values
        self.config_path.write_text(render_toml(sections))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}/status"

    def command(self) -> list[str]:
        """The agent's argv: `imexd run` of the installed package, whatever the folder."""
        return python_module("imexd", "run", "--config", str(self.config_path))

    async def start(self, env: Mapping[str, str]) -> None:
        """Start `imexd run` in its own session: Ctrl-C reaches the demo, not the agents."""
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=dict(env),
                start_new_session=True,
            )
        self.agent = "starting"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        """SIGKILL the agent alone, as a crash: its daemon runs on."""
        if self.proc is not None and self.alive():
            self.proc.kill()
            await self.proc.wait()
        self.agent = "down"

    async def stop(self, grace_s: float = AGENT_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM: the agent leaves the domain and stops its daemon; its exit status,
        None if it had to be killed."""
        if self.proc is None:
            return 0
        if self.alive():
            self.agent = "leaving"
            self.proc.terminate()
        try:
            async with asyncio.timeout(grace_s):
                code = await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            self.agent = "exited"
            return None
        self.agent = "left" if code == 0 else "exited"
        return code

    def row(self) -> Row:
        return Row(self.name, self.address, self.agent, self.report, self.orphan_pid, self.stopped)


def node_settings(
    *, nodes: int, broker_url: str, topic_prefix: str, ports: tuple[int, int], folder: Path
) -> dict[str, dict[str, object]]:
    """The settings every node shares: the domain, the broker, the simulator, the timings."""
    sections: dict[str, dict[str, object]] = {
        "node": {"clique": CLIQUE},
        "domain": {"name": DOMAIN, "max_nodes": nodes},
        "bus": {"url": [broker_url], "topic_prefix": topic_prefix},
        "imex": {
            "binary": _tool("imexd-sim-daemon", "imexd.sim.daemon", folder),
            "ctl": _tool("imexd-sim-ctl", "imexd.sim.ctl", folder),
            "server_port": ports[0],
            "cmd_port": ports[1],
        },
        "daemon": {},
        "health": {},
        "log": {"level": "info", "format": "json"},
    }
    return with_fast(sections)
