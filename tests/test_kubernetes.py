"""The Kubernetes manifests and the Containerfile, checked offline.

Every manifest is validated against the Kubernetes OpenAPI schema bundled with
kubernetes-validate (strict: unknown fields are errors), then checked against the agent
itself: the effective settings of each agent container (its ConfigMap plus its
environment, with made-up downward API values) must load, the probes must hit the
agent's routes at the address it listens on, and what it writes must be mounted
writable. The Containerfile cannot be built here (no container engine): it is linted.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from imexd.cli.main import build_parser
from imexd.health.http import PATHS
from imexd.messages import Condition, DaemonInfo, DomainView, HealthReport, SlotView, encode
from imexd.settings import (
    DEFAULT_CONFIG_PATH,
    SHUTDOWN_MARGIN_S,
    Settings,
    iter_settings,
    parse_listen,
)
from imexd.settings import settings_from_mapping as load_mapping

ROOT = Path(__file__).resolve().parent.parent
MANIFEST_DIR = ROOT / "config" / "kubernetes"
MANIFESTS = sorted(MANIFEST_DIR.glob("*.yaml"))
CONTAINERFILE = ROOT / "Containerfile"

KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
"""1.29: the oldest release with native sidecars on by default (sidecar.yaml)."""
IMEX_PERSIST_DIR = "/run/nvidia-imex"
"""Where nvidia-imex keeps persist.dat; it must outlive the container."""
AGENT_RSS_BYTES = 55 * 2**20
"""The agent's resident memory target; the container also holds the IMEX daemon."""
DOWNWARD = {
    "spec.nodeName": "gpu-node-01.rack1",
    "status.hostIP": "10.0.0.11",
    "status.podIP": "10.0.0.11",
}
"""Made-up downward API values: a host-network pod's IP is its node's."""
LABEL_VALUE = "train-42"
"""What a `metadata.labels[...]` reference resolves to here."""

Doc = dict[str, Any]


def load(path: Path) -> list[Doc]:
    with path.open() as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


DOCS = [
    (path.name, i, doc)
    for path in MANIFESTS
    for i, doc in enumerate(load(path))
    # The Prometheus Operator's objects have no schema in kubernetes-validate (CRDs):
    # tests/test_prometheus.py checks them against their CRD fields and promtool.
    if not doc["apiVersion"].startswith("monitoring.coreos.com/")
]


def pod_spec(doc: Doc) -> Doc | None:
    if doc["kind"] == "Pod":
        return dict(doc["spec"])
    if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
        return dict(doc["spec"]["template"]["spec"])
    return None


def agents() -> Iterator[tuple[str, Doc, Doc, Doc]]:
    """(file, workload, pod spec, container) for every imexd container."""
    for name, _, doc in DOCS:
        spec = pod_spec(doc)
        if spec is None:
            continue
        for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            if container["name"] == "imexd":
                yield name, doc, spec, container


AGENTS = list(agents())
AGENT_IDS = [f"{name}:{doc['kind']}" for name, doc, _, _ in AGENTS]


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: only variables defined earlier; $$ escapes."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


def environment(container: Doc) -> dict[str, str]:
    """The container's environment as the kubelet would build it, downward API faked."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            value = expand(str(var["value"]), env)
            assert "$(" not in value, f"{var['name']}: unresolved reference in {var['value']!r}"
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            value = LABEL_VALUE if field.startswith("metadata.labels[") else DOWNWARD[field]
        env[var["name"]] = value
    return env


def mounts(container: Doc) -> dict[str, Doc]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def volume(spec: Doc, name: str) -> Doc:
    found: list[Doc] = [v for v in spec.get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"volume {name!r} defined {len(found)} times"
    return found[0]


def mount_of(container: Doc, path: str) -> Doc | None:
    """The volume mount that holds `path` (the deepest one)."""
    best: Doc | None = None
    for mount_path, mount in mounts(container).items():
        inside = path == mount_path or path.startswith(mount_path.rstrip("/") + "/")
        if inside and (best is None or len(mount_path) > len(best["mountPath"])):
            best = mount
    return best


def config_map(doc: Doc, name: str) -> Doc:
    namespace = doc["metadata"].get("namespace")
    found = [
        d
        for _, _, d in DOCS
        if d["kind"] == "ConfigMap"
        and d["metadata"]["name"] == name
        and d["metadata"].get("namespace") == namespace
    ]
    assert len(found) == 1, f"ConfigMap {namespace}/{name}: {len(found)} in config/kubernetes"
    return found[0]


def agent_args(container: Doc) -> list[str]:
    """The container's argv after the image's entrypoint."""
    assert "command" not in container, "keep the image's entrypoint (tini, imexd run)"
    return [str(a) for a in container["args"]]


def effective(doc: Doc, spec: Doc, container: Doc) -> Settings:
    """The settings the agent would load: its ConfigMap file plus its environment."""
    args = build_parser().parse_args(["run", *agent_args(container)])
    config = Path(args.config)
    mount = mount_of(container, str(config))
    assert mount is not None, f"{config} is not mounted"
    source = volume(spec, mount["name"])
    assert "configMap" in source, f"{config} should come from a ConfigMap"
    key = str(config.relative_to(mount["mountPath"]))
    text = config_map(doc, source["configMap"]["name"])["data"][key]
    return load_mapping(tomllib.loads(text), environ=environment(container), source=str(config))


def quantity(text: str) -> int:
    """A Kubernetes memory quantity in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|K|M|G)?", text)
    assert match, text
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    return int(match.group(1)) * scale.get(match.group(2) or "", 1)


def default(section: str, key: str) -> object:
    return next(s.default for s in iter_settings() if (s.section, s.key) == (section, key))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("name", "index", "doc"), DOCS, ids=[f"{n}#{i}" for n, i, _ in DOCS])
def test_manifest_matches_the_kubernetes_schema(
    name: str, index: int, doc: Doc, version: str
) -> None:
    """Each manifest validates strictly against the Kubernetes OpenAPI schema, offline."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name} document {index} ({doc['kind']}), k8s {version}: {where}: {exc}")


def test_the_schema_check_catches_a_misspelt_field() -> None:
    """The strict schema rejects an unknown field, so the check above is not blind."""
    doc = json.loads(json.dumps(AGENTS[0][1]))
    pod_spec_of = doc["spec"]["template"]["spec"]
    agent = next(c for c in pod_spec_of["containers"] if c["name"] == "imexd")
    agent["readinesProbe"] = agent.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


def test_there_is_a_daemonset_and_a_sidecar_agent() -> None:
    """The manifests hold both layouts: a DaemonSet and a Job with a native sidecar."""
    kinds = {(name, doc["kind"]) for name, doc, _, _ in AGENTS}
    assert kinds == {("daemonset.yaml", "DaemonSet"), ("sidecar.yaml", "Job")}


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_environment_names_real_settings(name: str, doc: Doc, spec: Doc, container: Doc) -> None:
    """Every IMEXD_* variable in a manifest is a real setting's override."""
    known = {s.env for s in iter_settings()}
    names = [v["name"] for v in container.get("env", [])]
    assert len(names) == len(set(names))
    imexd_names = {n for n in names if n.startswith("IMEXD_")}
    assert imexd_names <= known, imexd_names - known
    assert spec.get("enableServiceLinks") is False, "Service links would add IMEXD_* look-alikes"


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_node_identity_comes_from_the_downward_api(
    name: str, doc: Doc, spec: Doc, container: Doc
) -> None:
    """The node name is the Kubernetes node's and the address is the host's IP."""
    refs = {
        v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"]
        for v in container["env"]
        if "valueFrom" in v
    }
    assert refs["IMEXD_NODE_NAME"] == "spec.nodeName"
    assert refs["IMEXD_NODE_ADDRESS"] == "status.hostIP"
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec.get("automountServiceAccountToken") is False


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_effective_settings_load(name: str, doc: Doc, spec: Doc, container: Doc) -> None:
    """The agent's ConfigMap plus its environment is a valid configuration for this node."""
    settings = effective(doc, spec, container)
    assert settings.node.name == DOWNWARD["spec.nodeName"]
    assert settings.node.address == DOWNWARD["status.hostIP"]
    assert settings.bus.username == settings.node.name, "broker ACLs match %u to the node"
    if name == "sidecar.yaml":
        assert settings.domain.name == LABEL_VALUE
    else:
        assert settings.domain.assigned


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_probes_reach_the_agent(name: str, doc: Doc, spec: Doc, container: Doc) -> None:
    """httpGet probes use the agent's routes on its port, at the pod IP it listens on."""
    settings = effective(doc, spec, container)
    host, port = parse_listen(settings.health.listen)
    # The kubelet probes the pod IP, which a host-network pod shares with its node.
    assert host == DOWNWARD["status.podIP"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == port
    expected = {"livenessProbe": {"/healthz"}, "readinessProbe": {"/readyz"}}
    expected["startupProbe"] = {"/healthz", "/readyz"}
    for probe, paths in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] in paths, f"{probe} asks {get['path']}"
        assert get["path"] in PATHS
        assert ports.get(get["port"], get["port"]) == port
        assert "host" not in get, "the pod IP is where the agent listens"


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_imex_ports_are_declared(name: str, doc: Doc, spec: Doc, container: Doc) -> None:
    """The IMEX ports are declared, so the scheduler never places two daemons on a node."""
    settings = effective(doc, spec, container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["imex"] == settings.imex.server_port == default("imex", "server_port")
    assert ports["imex-cmd"] == settings.imex.cmd_port == default("imex", "cmd_port")


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_written_paths_are_writable_mounts(name: str, doc: Doc, spec: Doc, container: Doc) -> None:
    """Run dir, state dir and IMEX's persist dir are writable volumes; the root is read-only."""
    settings = effective(doc, spec, container)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for path in (settings.imex.run_dir, settings.node.state_dir, IMEX_PERSIST_DIR, "/tmp"):
        mount = mounts(container).get(path)
        assert mount is not None, f"{path} is not a volume"
        assert not mount.get("readOnly", False), f"{path} is mounted read-only"
    for path in (settings.node.state_dir, IMEX_PERSIST_DIR):
        source = volume(spec, mounts(container)[path]["name"])
        assert source["hostPath"]["path"] == path, f"{path} must outlive the pod"
    # The kubelet's own /etc/hosts bind mount is the supported target (rewritten in place).
    assert settings.imex.hosts_file == "/etc/hosts"
    assert mount_of(container, "/etc/hosts") is None


def test_the_daemonset_makes_channels_on_the_node() -> None:
    """The DaemonSet agent makes workloads' channel nodes, CDI specs and env files in the
    node's folders (hostPath), not in its container's copy of /dev, where no pod sees them."""
    name, doc, spec, container = next(a for a in AGENTS if a[1]["kind"] == "DaemonSet")
    settings = effective(doc, spec, container)
    assert settings.channels.manage
    assert container["securityContext"]["privileged"] is True  # mknod, chown, any device
    for path in (settings.channels.dev_dir, settings.channels.cdi_dir, settings.channels.env_dir):
        mount = mounts(container).get(path)
        assert mount is not None, f"{name}: {path} is not a volume"
        assert not mount.get("readOnly", False), f"{path} is mounted read-only"
        assert volume(spec, mount["name"])["hostPath"]["path"] == path, f"{path} is not the node's"


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_imex_binaries_and_secrets_are_mounted(
    name: str, doc: Doc, spec: Doc, container: Doc
) -> None:
    """nvidia-imex and its ctl come from the host; broker credentials from a Secret."""
    settings = effective(doc, spec, container)
    for binary in (settings.imex.binary, settings.imex.ctl):
        mount = mounts(container).get(binary)
        assert mount is not None, f"{binary} is not mounted from the host"
        source = volume(spec, mount["name"])
        assert source["hostPath"]["type"] == "File"
    for path in (settings.bus.password_file, settings.bus.ca_file):
        mount = mount_of(container, path)
        assert mount is not None, f"{path} is not mounted"
        assert "secret" in volume(spec, mount["name"])


@pytest.mark.parametrize(("name", "doc", "spec", "container"), AGENTS, ids=AGENT_IDS)
def test_shutdown_and_resources_fit_the_agent(
    name: str, doc: Doc, spec: Doc, container: Doc
) -> None:
    """The grace period covers the bounded shutdown; memory fits agent plus daemon."""
    stop_timeout_s = default("daemon", "stop_timeout_s")
    assert isinstance(stop_timeout_s, float)
    assert spec["terminationGracePeriodSeconds"] >= stop_timeout_s + SHUTDOWN_MARGIN_S + 10
    resources = container["resources"]
    assert quantity(resources["requests"]["memory"]) >= 2 * AGENT_RSS_BYTES
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])
    assert "cpu" not in resources["limits"], "CPU throttling delays heartbeats and probes"
    security = container["securityContext"]
    assert security["privileged"] is True
    assert security.get("allowPrivilegeEscalation", True) is True, "rejected with privileged"


def test_daemonset_is_replaced_only_on_delete() -> None:
    """The DaemonSet runs on GPU nodes and never restarts IMEX by a rolling update."""
    (doc,) = [d for _, _, d in DOCS if d["kind"] == "DaemonSet"]
    assert doc["spec"]["updateStrategy"]["type"] == "OnDelete"
    spec = doc["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert doc["spec"]["selector"]["matchLabels"].items() <= (
        doc["spec"]["template"]["metadata"]["labels"].items()
    )
    namespaces = {d["metadata"]["name"]: d for _, _, d in DOCS if d["kind"] == "Namespace"}
    labels = namespaces[doc["metadata"]["namespace"]]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_daemonset_sees_the_hosts_processes() -> None:
    """hostPID: a host nvidia-imex.service or another IMEX pod is visible to the conflict check."""
    (doc,) = [d for _, _, d in DOCS if d["kind"] == "DaemonSet"]
    spec = doc["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert "shareProcessNamespace" not in spec, "a shared pod namespace hides the host's"
    (agent,) = spec["containers"]
    assert environment(agent)["TINI_SUBREAPER"] == "1", "tini is not PID 1 with hostPID"


def _job() -> tuple[Doc, Doc]:
    (doc,) = [d for _, _, d in DOCS if d["kind"] == "Job"]
    return doc, doc["spec"]["template"]["spec"]


def test_sidecar_starts_before_the_workload() -> None:
    """The agent is a native sidecar gated on readiness; the domain gate runs after it."""
    _, spec = _job()
    agent, gate = spec["initContainers"]
    assert agent["name"] == "imexd"
    assert agent["restartPolicy"] == "Always"
    assert agent["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert gate["name"] == "imex-domain-gate"
    assert "restartPolicy" not in gate, "a plain init container: it must finish first"
    assert [c["name"] for c in spec["containers"]] == ["workload"]
    domain = next(v for v in agent["env"] if v["name"] == "IMEXD_DOMAIN_NAME")
    assert domain["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['batch.kubernetes.io/job-name']"
    )


def test_sidecar_pods_share_one_clique_one_per_node() -> None:
    """Pod affinity on the clique label keeps the Job in one clique; anti-affinity, one per node."""
    doc, spec = _job()
    job = {"batch.kubernetes.io/job-name": doc["metadata"]["name"]}
    affinity = spec["affinity"]
    (together,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together == {
        "labelSelector": {"matchLabels": job},
        "topologyKey": "nvidia.com/gpu.clique",
    }
    (apart,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart == {"labelSelector": {"matchLabels": job}, "topologyKey": "kubernetes.io/hostname"}
    (term,) = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.clique", "operator": "Exists"}]


def _gate() -> tuple[str, dict[str, str]]:
    """The domain gate's Python program and its environment, downward API faked."""
    _, spec = _job()
    (gate,) = [c for c in spec["initContainers"] if c["name"] == "imex-domain-gate"]
    assert gate["command"] == ["python3", "-c"]
    (program,) = gate["args"]
    return str(program), environment(gate)


def test_the_domain_gate_asks_the_sidecar_for_the_whole_job() -> None:
    """The gate reads the sidecar's /status where it listens and waits for every pod's node."""
    doc, spec = _job()
    _, env = _gate()
    (agent,) = [c for c in spec["initContainers"] if c["name"] == "imexd"]
    listen = environment(agent)["IMEXD_HEALTH_LISTEN"]
    assert env["AGENT_URL"] == f"http://{listen}"
    assert int(env["GATE_NODES"]) == doc["spec"]["completions"] == doc["spec"]["parallelism"]
    assert float(env["GATE_TIMEOUT_S"]) > 0


class _StatusServer:
    """A stand-in agent answering /status with one HealthReport, on a free loopback port."""

    def __init__(self) -> None:
        self.body = b"{}"
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def serve(self, up: bool, ready: int, of: int = 4) -> None:
        nodes = {
            str(slot): SlotView(
                node=f"gpu-{slot}",
                status="READY" if slot < ready else "UNAVAILABLE",
                connected=slot < ready,
            )
            for slot in range(of)
        }
        condition = Condition(
            type="DomainUp",
            status="True" if up else "False",
            reason="Up" if up else "PeersUnreachable",
            message="",
            since=0.0,
        )
        report = HealthReport(
            node="gpu-0",
            domain="train-42",
            clique="c.1",
            slot=0,
            incarnation=1,
            at=0.0,
            ready=True,
            conditions=[condition],
            daemon=DaemonInfo(state="RUNNING", pid=7),
            domain_view=DomainView(status="UP" if up else "DEGRADED", nodes=nodes),
        )
        self.body = encode(report)


@pytest.fixture
def status_server() -> Iterator[_StatusServer]:
    server = _StatusServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


def _run_gate(url: str, timeout_s: str = "0.5") -> subprocess.CompletedProcess[str]:
    program, env = _gate()
    env |= {"AGENT_URL": url, "GATE_TIMEOUT_S": timeout_s}
    return subprocess.run(
        [sys.executable, "-c", program],
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("up", "ready", "said"),
    [
        (True, 3, "DomainUp True Up; 3 of 4 nodes READY and connected: gpu-0 gpu-1 gpu-2"),
        (False, 4, "DomainUp False PeersUnreachable; 4 of 4 nodes READY"),
    ],
)
def test_the_domain_gate_holds_until_every_node_is_up(
    status_server: _StatusServer, up: bool, ready: int, said: str
) -> None:
    """3 of 4 nodes, or DomainUp False, fails the gate at its deadline, saying what it saw."""
    status_server.serve(up=up, ready=ready)
    run = _run_gate(status_server.url)
    assert run.returncode == 1
    assert run.stderr.startswith("imex-domain-gate: not up within 0.5 s: ")
    assert said in run.stderr


def test_the_domain_gate_passes_when_the_domain_is_up(status_server: _StatusServer) -> None:
    """Every node READY and connected with DomainUp True lets the workload start."""
    status_server.serve(up=True, ready=4)
    run = _run_gate(status_server.url, timeout_s="30")
    assert run.returncode == 0, run.stderr
    assert run.stdout == (
        "imex-domain-gate: domain up: DomainUp True Up; 4 of 4 nodes READY and connected: "
        "gpu-0 gpu-1 gpu-2 gpu-3\n"
    )


def test_the_domain_gate_names_an_unreachable_agent() -> None:
    """No agent answering: the gate fails at its deadline naming the URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    run = _run_gate(url)
    assert run.returncode == 1
    assert run.stderr.startswith(f"imex-domain-gate: not up within 0.5 s: {url}/status: ")


def instructions(text: str) -> list[tuple[str, str]]:
    """Containerfile instructions (keyword, arguments), continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    out: list[tuple[str, str]] = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_containerfile_is_well_formed() -> None:
    """The Containerfile builds the agent on python:3.11-slim and runs `imexd run`."""
    steps = instructions(CONTAINERFILE.read_text())
    froms = [args.split()[0] for key, args in steps if key == "FROM"]
    assert froms
    assert froms[-1] == "python:3.11-slim-bookworm"
    assert all(f.startswith("python:3.11-slim-bookworm") for f in froms)
    assert not [a for k, a in steps if k == "ADD"], "COPY only: no remote or archive ADD"
    for key, args in steps:
        if key == "COPY" and not args.startswith("--from"):
            for source in shlex.split(args)[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    (entrypoint,) = [json.loads(a) for k, a in steps if k == "ENTRYPOINT"]
    assert entrypoint[-2:] == ["imexd", "run"]
    (cmd,) = [json.loads(a) for k, a in steps if k == "CMD"]
    assert build_parser().parse_args(["run", *cmd]).config == DEFAULT_CONFIG_PATH
    (healthcheck,) = [a for k, a in steps if k == "HEALTHCHECK"]
    probe = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert probe == ["imexd", "check", "--live"]
    assert build_parser().parse_args(probe[1:]).live
    users = [a for k, a in steps if k == "USER"]
    assert users[-1:] == ["0"], "root, stated on purpose (see the Containerfile)"


def test_manifest_args_match_the_image_default() -> None:
    """Every agent container passes the same --config as the image's CMD."""
    steps = instructions(CONTAINERFILE.read_text())
    (cmd,) = [json.loads(a) for k, a in steps if k == "CMD"]
    for _, _, _, container in AGENTS:
        assert agent_args(container) == cmd
