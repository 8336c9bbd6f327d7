"""The deployment files under deploy/ refer only to things that exist.

No cluster or docker daemon is involved: every YAML document is loaded and checked against the
code (the settings it reads, the `aenv` commands and options) and against the other documents
(Secrets, ConfigMaps, volumes, Services, ports, etcd members, compose dependencies). Each check
returns the problems it finds, so the tests at the end can show that a broken copy of a file
(an unknown setting, a missing Secret, ...) is caught.
"""

from __future__ import annotations

import copy
import ipaddress
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from agentenv.cli.main import app
from agentenv.config import DEFAULT_SLOT_CIDR
from agentenv.hostdeps import HOST_PACKAGES

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
DEFAULT_SLOTS = ipaddress.IPv4Network(DEFAULT_SLOT_CIDR)
# The agentenv image's name in the manifests (kustomization.yaml's `images` rewrites it).
K8S_IMAGE = "agentenv"
ENV_TOKEN = re.compile(r"\bAGENTENV_[A-Z0-9_]*[A-Z0-9]\b")

Doc = dict[str, Any]


@dataclass
class Bundle:
    """Everything under deploy/, loaded."""

    k8s: list[tuple[str, Doc]]  # (file name, document), kustomization.yaml excluded
    kustomization: Doc
    compose: Doc
    dockerfile: str
    entrypoint: str


def load_bundle() -> Bundle:
    k8s: list[tuple[str, Doc]] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                k8s.append((path.name, doc))
    return Bundle(
        k8s=k8s,
        kustomization=yaml.safe_load((K8S / "kustomization.yaml").read_text()),
        compose=yaml.safe_load((DEPLOY / "compose.yaml").read_text()),
        dockerfile=(DEPLOY / "Dockerfile").read_text(),
        entrypoint=(DEPLOY / "agentenv-entrypoint.sh").read_text(),
    )


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return load_bundle()


def known_env_names() -> set[str]:
    """Every `AGENTENV_*` name the source reads: a string literal that is exactly the name."""
    names: set[str] = set()
    for path in (REPO / "src" / "agentenv").rglob("*.py"):
        names.update(re.findall(r"""["'](AGENTENV_[A-Z0-9_]*[A-Z0-9])["']""", path.read_text()))
    return names


# -- helpers over the Kubernetes documents ----------------------------------------------------


def defined(b: Bundle, kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for _, d in b.k8s if d.get("kind") == kind}


def workloads(b: Bundle) -> Iterator[Doc]:
    for _, d in b.k8s:
        if d.get("kind") in WORKLOADS:
            yield d


def pod_spec(w: Doc) -> Doc:
    spec: Doc = w["spec"]["template"]["spec"]
    return spec


def containers(w: Doc) -> list[Doc]:
    spec = pod_spec(w)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def env_of(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def env_value(b: Bundle, c: Doc, name: str) -> str | None:
    """A container's literal value of `name`: its own env, else a ConfigMap it takes whole."""
    entry = env_of(c).get(name)
    if entry is not None:
        return entry.get("value")
    maps = defined(b, "ConfigMap")
    for source in c.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref and ref["name"] in maps and name in maps[ref["name"]].get("data", {}):
            return str(maps[ref["name"]]["data"][name])
    return None


def env_available(b: Bundle, c: Doc, name: str) -> bool:
    """Whether `name` reaches the container at all (literal, downward API, Secret, ConfigMap)."""
    return name in env_of(c) or env_value(b, c, name) is not None


def k8s_env_names(b: Bundle) -> set[str]:
    names = {n for w in workloads(b) for c in containers(w) for n in env_of(c)}
    maps = defined(b, "ConfigMap")
    for w in workloads(b):
        for c in containers(w):
            for source in c.get("envFrom", []):
                ref = source.get("configMapRef")
                if ref and ref["name"] in maps:
                    names.update(maps[ref["name"]].get("data", {}))
    return names


def agent_argv(b: Bundle) -> Iterator[tuple[str, list[str]]]:
    """(where, argv after `aenv`) for every container that runs the agentenv image (whose
    entrypoint execs `aenv "$@"`)."""
    for w in workloads(b):
        for c in containers(w):
            if c["image"].split(":")[0] == K8S_IMAGE:
                assert "command" not in c, "the image's entrypoint must stay (it execs aenv)"
                yield (
                    f"{w['kind']}/{w['metadata']['name']}/{c['name']}",
                    [str(a) for a in c.get("args", [])],
                )


def role(b: Bundle, first: str) -> list[tuple[Doc, Doc]]:
    """(workload, container) pairs whose `aenv` command starts with `first`."""
    found = []
    for w in workloads(b):
        for c in pod_spec(w).get("containers", []):
            if c["image"].split(":")[0] == K8S_IMAGE and c.get("args", [None])[0] == first:
                found.append((w, c))
    return found


def flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` / `-name=value` arguments as {name: value}."""
    out: dict[str, str] = {}
    for arg in argv:
        if arg.startswith("-") and "=" in arg:
            key, _, value = arg.lstrip("-").partition("=")
            out[key] = value
    return out


def port_of(hostport: str) -> int:
    return int(hostport.rpartition(":")[2])


def slot_range_problems(where: str, ranges: dict[str, str]) -> list[str]:
    problems: list[str] = []
    nets: dict[str, ipaddress.IPv4Network] = {}
    for key, raw in ranges.items():
        try:
            net = ipaddress.IPv4Network(str(raw).strip())
        except ValueError as exc:
            problems.append(f"{where}: {key}'s slot range {raw!r} is not a network: {exc}")
            continue
        if not net.subnet_of(DEFAULT_SLOTS):
            problems.append(f"{where}: {key}'s slot range {net} is outside {DEFAULT_SLOTS}")
        if net.prefixlen > 30:
            problems.append(f"{where}: {key}'s slot range {net} holds no slot")
        for other, seen in nets.items():
            if net.overlaps(seen):
                problems.append(f"{where}: slot ranges of {key} and {other} overlap")
        nets[key] = net
    return problems


# -- checks shared by both forms ---------------------------------------------------------------


def check_env_names(names: set[str], known: set[str], where: str) -> list[str]:
    return [
        f"{where}: {name} is not a setting agentenv reads"
        for name in sorted(names)
        if name.startswith("AGENTENV_") and name not in known
    ]


def cli_problems(where: str, argv: list[str]) -> list[str]:
    """`aenv <argv>` names commands and options the typer app has."""
    # Typer 0.29 carries its own copy of click, so commands are told apart by what they have:
    # a group has `commands`.
    cmd: Any = typer.main.get_command(app)
    path: list[str] = []
    for token in argv:
        if token.startswith("-"):
            name = token.partition("=")[0]
            opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
            if name not in opts and name != "--help":
                return [f"{where}: `aenv {' '.join(path)}` has no option {name}"]
        elif hasattr(cmd, "commands"):
            sub = cmd.commands.get(token)
            if sub is None:
                return [f"{where}: `aenv {' '.join(path)}` has no command {token!r}"]
            cmd = sub
            path.append(token)
        # Anything else is an argument of a leaf command.
    if hasattr(cmd, "commands") and not cmd.invoke_without_command and "--help" not in argv:
        return [f"{where}: `aenv {' '.join(path)}` needs a subcommand"]
    result = CliRunner().invoke(app, [*path, "--help"])
    if result.exit_code != 0:
        return [f"{where}: `aenv {' '.join(path)} --help` failed: {result.output[-300:]}"]
    return []


# -- Kubernetes --------------------------------------------------------------------------------


def check_kustomization(b: Bundle) -> list[str]:
    problems = []
    listed = b.kustomization.get("resources", [])
    for name in listed:
        if not (K8S / name).is_file():
            problems.append(f"kustomization.yaml: resource {name} does not exist")
    files = {name for name, _ in b.k8s}
    for name in sorted(files - set(listed)):
        problems.append(f"kustomization.yaml: {name} is not listed in resources")
    images = {i["name"] for i in b.kustomization.get("images", [])}
    if K8S_IMAGE not in images:
        problems.append(f"kustomization.yaml: no `images` entry for {K8S_IMAGE}")
    return problems


def check_k8s_refs(b: Bundle) -> list[str]:
    problems: list[str] = []
    secrets, maps, services = defined(b, "Secret"), defined(b, "ConfigMap"), defined(b, "Service")

    def keys(kind: str, name: str) -> set[str]:
        doc = (secrets if kind == "Secret" else maps)[name]
        return {*doc.get("data", {}), *doc.get("stringData", {})}

    def ref(where: str, kind: str, name: str, key: str | None = None) -> None:
        table = secrets if kind == "Secret" else maps
        if name not in table:
            problems.append(f"{where}: {kind} {name} is not defined")
        elif key is not None and key not in keys(kind, name):
            problems.append(f"{where}: {kind} {name} has no key {key}")

    for w in workloads(b):
        wname = f"{w['kind']}/{w['metadata']['name']}"
        spec = pod_spec(w)
        labels = w["spec"]["template"]["metadata"].get("labels", {})
        for k, v in w["spec"]["selector"]["matchLabels"].items():
            if labels.get(k) != v:
                problems.append(f"{wname}: selector {k}={v} does not match its pod labels")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for v in volumes.values():
            if "configMap" in v:
                ref(f"{wname} volume {v['name']}", "ConfigMap", v["configMap"]["name"])
            if "secret" in v:
                ref(f"{wname} volume {v['name']}", "Secret", v["secret"]["secretName"])
        if w["kind"] == "StatefulSet" and w["spec"]["serviceName"] not in services:
            problems.append(f"{wname}: serviceName {w['spec']['serviceName']} is not defined")
        for c in containers(w):
            where = f"{wname}/{c['name']}"
            seen: set[str] = set()
            for e in c.get("env", []):
                source = e.get("valueFrom", {})
                if "secretKeyRef" in source:
                    r = source["secretKeyRef"]
                    ref(f"{where} env {e['name']}", "Secret", r["name"], r["key"])
                if "configMapKeyRef" in source:
                    r = source["configMapKeyRef"]
                    ref(f"{where} env {e['name']}", "ConfigMap", r["name"], r["key"])
                # $(VAR) expands only a variable defined earlier in the list.
                for var in re.findall(r"\$\(([A-Za-z0-9_]+)\)", str(e.get("value", ""))):
                    if var not in seen:
                        problems.append(f"{where} env {e['name']}: $({var}) is not defined before")
                seen.add(e["name"])
            for arg in [*c.get("command", []), *c.get("args", [])]:
                for var in re.findall(r"\$\(([A-Za-z0-9_]+)\)", str(arg)):
                    if var not in seen:
                        problems.append(f"{where}: argument {arg!r} uses undefined $({var})")
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    ref(f"{where} envFrom", "ConfigMap", source["configMapRef"]["name"])
                if "secretRef" in source:
                    ref(f"{where} envFrom", "Secret", source["secretRef"]["name"])
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes and m["name"] not in claims:
                    problems.append(f"{where}: volume {m['name']} is not defined")
    for name, svc in services.items():
        selector = svc["spec"].get("selector", {})
        chosen = [
            w
            for w in workloads(b)
            if all(
                w["spec"]["template"]["metadata"].get("labels", {}).get(k) == v
                for k, v in selector.items()
            )
        ]
        if not chosen:
            problems.append(f"Service {name}: its selector {selector} matches no workload")
            continue
        ports = [p for w in chosen for c in containers(w) for p in c.get("ports", [])]
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            known = (
                {q.get("name") for q in ports}
                if isinstance(target, str)
                else {q["containerPort"] for q in ports}
            )
            if target not in known:
                problems.append(f"Service {name}: targetPort {target} is no container port")
    return problems


def check_k8s_ports(b: Bundle) -> list[str]:
    """Binds the env sets are ports the containers declare; etcd endpoints are members."""
    problems: list[str] = []
    for w in workloads(b):
        for c in containers(w):
            where = f"{w['kind']}/{w['metadata']['name']}/{c['name']}"
            declared = {p["containerPort"] for p in c.get("ports", [])}
            for name in ("AGENTENV_BIND", "AGENTENV_NODE_BIND"):
                raw = env_value(b, c, name)
                if raw is not None and port_of(raw) not in declared:
                    problems.append(f"{where}: {name}={raw} but ports are {sorted(declared)}")
            bind, url = env_value(b, c, "AGENTENV_NODE_BIND"), env_value(b, c, "AGENTENV_NODE_URL")
            if bind and url and urlsplit(url).port != port_of(bind):
                problems.append(f"{where}: AGENTENV_NODE_URL={url} is not the bind's port")
            etcd = env_value(b, c, "AGENTENV_ETCD")
            if etcd:
                problems += etcd_endpoint_problems(b, where, etcd)
    return problems


def etcd_endpoint_problems(b: Bundle, where: str, raw: str) -> list[str]:
    problems = []
    sets = defined(b, "StatefulSet")
    for endpoint in raw.split(","):
        host, port = endpoint.rsplit(":", 1)
        pod, _, service = host.partition(".")
        sts_name, _, index = pod.rpartition("-")
        sts = sets.get(sts_name)
        if sts is None or not index.isdigit() or int(index) >= sts["spec"]["replicas"]:
            problems.append(f"{where}: etcd endpoint {endpoint} is no StatefulSet member")
            continue
        if service != sts["spec"]["serviceName"]:
            problems.append(f"{where}: etcd endpoint {endpoint} is not under its Service")
        listen = flags(sts["spec"]["template"]["spec"]["containers"][0].get("args", []))
        if urlsplit(listen.get("listen-client-urls", "")).port != int(port):
            problems.append(f"{where}: etcd endpoint {endpoint} is not the client port")
    return problems


def check_k8s_etcd(b: Bundle) -> list[str]:
    problems: list[str] = []
    for name, sts in defined(b, "StatefulSet").items():
        c = sts["spec"]["template"]["spec"]["containers"][0]
        args = flags([*c.get("command", []), *c.get("args", [])])
        if "initial-cluster" not in args:
            continue
        replicas, service = sts["spec"]["replicas"], sts["spec"]["serviceName"]
        members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
        expected = {f"{name}-{i}" for i in range(replicas)}
        if set(members) != expected:
            problems.append(
                f"StatefulSet/{name}: --initial-cluster names {sorted(members)}, "
                f"its pods are {sorted(expected)}"
            )
        peer_port = urlsplit(args.get("listen-peer-urls", "")).port
        for member, url in members.items():
            parts = urlsplit(url)
            if parts.hostname != f"{member}.{service}" or parts.port != peer_port:
                problems.append(f"StatefulSet/{name}: member {member}'s peer URL {url} is wrong")
        if (
            args.get("name") != "$(POD_NAME)"
            or env_of(c)
            .get("POD_NAME", {})
            .get("valueFrom", {})
            .get("fieldRef", {})
            .get("fieldPath")
            != "metadata.name"
        ):
            problems.append(f"StatefulSet/{name}: --name must be the pod's name")
        if "auto-compaction-retention" not in args:
            problems.append(f"StatefulSet/{name}: etcd needs auto-compaction (heartbeats write)")
    return problems


def check_k8s_node_agent(b: Bundle) -> list[str]:
    problems: list[str] = []
    agents = role(b, "node")
    if not agents:
        return ["no container runs `aenv node`"]
    for w, c in agents:
        where = f"{w['kind']}/{w['metadata']['name']}"
        spec = pod_spec(w)
        if w["kind"] != "DaemonSet":
            problems.append(f"{where}: the node agent must be a DaemonSet (one per host)")
        if not spec.get("hostNetwork"):
            problems.append(f"{where}: needs hostNetwork (slots are host netns, taps, nft)")
        if spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
            problems.append(f"{where}: hostNetwork needs dnsPolicy ClusterFirstWithHostNet")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for cont in [*spec.get("initContainers", []), c]:
            cwhere = f"{where}/{cont['name']}"
            sec = cont.get("securityContext", {})
            caps = set(sec.get("capabilities", {}).get("add", []))
            if not sec.get("privileged") and not {"SYS_ADMIN", "NET_ADMIN"} <= caps:
                problems.append(f"{cwhere}: needs privileged (netns, nft, taps, cgroups)")
            mounts = {m["mountPath"]: m for m in cont.get("volumeMounts", [])}
            host_dirs = {"/dev/kvm": "/dev/kvm", "/dev/net/tun": "/dev/net/tun"}
            for setting in ("AGENTENV_HOME", "AGENTENV_CACHE"):
                path = env_value(b, cont, setting)
                if path is None:
                    problems.append(f"{cwhere}: {setting} is not set")
                else:
                    host_dirs[path] = ""
            for path, host in host_dirs.items():
                mount = mounts.get(path)
                vol = volumes.get(mount["name"]) if mount else None
                if vol is None or "hostPath" not in vol:
                    problems.append(f"{cwhere}: {path} is not a hostPath mount")
                elif host and vol["hostPath"]["path"] != host:
                    problems.append(f"{cwhere}: {path} is not the host's {host}")
            problems += slot_range_wiring(b, cwhere, cont, volumes)
        if (
            env_of(c)
            .get("AGENTENV_NODE_ID", {})
            .get("valueFrom", {})
            .get("fieldRef", {})
            .get("fieldPath")
            != "spec.nodeName"
        ):
            problems.append(f"{where}: AGENTENV_NODE_ID must come from spec.nodeName")
        host_ip = env_of(c).get("HOST_IP", {}).get("valueFrom", {}).get("fieldRef", {})
        url = env_value(b, c, "AGENTENV_NODE_URL") or ""
        if host_ip.get("fieldPath") != "status.hostIP" or "$(HOST_IP)" not in url:
            problems.append(f"{where}: AGENTENV_NODE_URL must be the host IP (status.hostIP)")
        for setting in ("AGENTENV_ETCD", "AGENTENV_NODE_TOKEN"):
            if not env_available(b, c, setting):
                problems.append(f"{where}: {setting} is not set (a node agent needs it)")
    return problems


def slot_range_wiring(b: Bundle, where: str, c: Doc, volumes: dict[str, Doc]) -> list[str]:
    """Each node's AGENTENV_SLOT_CIDR: a literal value, or the file the entrypoint reads from
    the ConfigMap mounted at SLOT_RANGES_DIR."""
    literal = env_value(b, c, "AGENTENV_SLOT_CIDR")
    if literal is not None:
        return [f"{where}: one AGENTENV_SLOT_CIDR for every node of a DaemonSet"]
    directory = env_value(b, c, "SLOT_RANGES_DIR")
    if directory is None or "SLOT_RANGES_DIR" not in b.entrypoint:
        return [f"{where}: no per-node slot range (SLOT_RANGES_DIR)"]
    mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == directory), None)
    vol = volumes.get(mount["name"]) if mount else None
    if vol is None or "configMap" not in vol:
        return [f"{where}: SLOT_RANGES_DIR={directory} is no ConfigMap mount"]
    ranges = defined(b, "ConfigMap").get(vol["configMap"]["name"], {}).get("data", {})
    if not ranges:
        return [f"{where}: the slot ranges ConfigMap is empty"]
    return slot_range_problems(f"ConfigMap/{vol['configMap']['name']}", ranges)


def check_k8s_control(b: Bundle) -> list[str]:
    problems: list[str] = []
    planes = role(b, "serve")
    if not planes:
        return ["no container runs `aenv serve`"]
    services = defined(b, "Service").values()
    for w, c in planes:
        where = f"{w['kind']}/{w['metadata']['name']}"
        if w["kind"] != "Deployment" or w["spec"].get("replicas", 1) < 2:
            problems.append(f"{where}: the control plane is a Deployment of 2+ replicas")
        for setting in ("AGENTENV_ETCD", "AGENTENV_NODE_TOKEN", "AGENTENV_BIND"):
            if not env_available(b, c, setting):
                problems.append(f"{where}: {setting} is not set")
        labels = w["spec"]["template"]["metadata"].get("labels", {})
        if not any(
            s["spec"].get("selector")
            and all(labels.get(k) == v for k, v in s["spec"]["selector"].items())
            for s in services
        ):
            problems.append(f"{where}: no Service selects the control plane")
    return problems


# -- compose -----------------------------------------------------------------------------------


def service_argv(svc: Doc) -> list[str]:
    """A service's command, after the image's entrypoint."""
    command = svc.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def compose_agentenv(b: Bundle) -> dict[str, Doc]:
    return {
        name: svc
        for name, svc in b.compose["services"].items()
        if str(svc.get("image", "")).split(":")[0] == "agentenv"
    }


def compose_role(b: Bundle, first: str) -> dict[str, Doc]:
    return {n: s for n, s in compose_agentenv(b).items() if service_argv(s)[:1] == [first]}


def mounts_of(svc: Doc) -> dict[str, str]:
    """{target: source} of a service's volumes (short and long syntax)."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, _, rest = v.partition(":")
            out[rest.split(":")[0]] = source
        else:
            out[v["target"]] = v.get("source", "")
    return out


def check_compose_refs(b: Bundle) -> list[str]:
    problems: list[str] = []
    services = b.compose["services"]
    volumes = set(b.compose.get("volumes") or {})
    configs = set(b.compose.get("configs") or {})
    for name, svc in services.items():
        deps = svc.get("depends_on", [])
        for dep in deps if isinstance(deps, list) else deps.keys():
            if dep not in services:
                problems.append(f"compose {name}: depends_on {dep}, which is not a service")
        for target, source in mounts_of(svc).items():
            if source and not source.startswith(("/", ".")) and source not in volumes:
                problems.append(f"compose {name}: volume {source} ({target}) is not declared")
        for cfg in svc.get("configs", []):
            source = cfg if isinstance(cfg, str) else cfg["source"]
            if source not in configs:
                problems.append(f"compose {name}: config {source} is not declared")
        build = svc.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            if not (context / build.get("dockerfile", "Dockerfile")).is_file():
                problems.append(f"compose {name}: no Dockerfile at {build}")
            elif context != REPO:
                problems.append(f"compose {name}: the build context must be the repository")
    return problems


def check_compose_etcd(b: Bundle) -> list[str]:
    problems: list[str] = []
    members: dict[str, dict[str, str]] = {}
    for name, svc in b.compose["services"].items():
        args = flags(service_argv(svc))
        if "initial-cluster" in args:
            members[name] = args
    if len(members) < 3:
        problems.append(f"compose: {len(members)} etcd members, expected 3")
    names = {args.get("name", ""): args for args in members.values()}
    peers = {n: a.get("initial-advertise-peer-urls", "") for n, a in names.items()}
    for service, args in members.items():
        listed = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
        if listed != peers:
            problems.append(
                f"compose {service}: --initial-cluster {listed} is not the members {peers}"
            )
        if (
            urlsplit(args.get("listen-peer-urls", "")).port
            != urlsplit(args.get("initial-advertise-peer-urls", "")).port
        ):
            problems.append(f"compose {service}: advertises a peer port it does not listen on")
        if "auto-compaction-retention" not in args:
            problems.append(f"compose {service}: etcd needs auto-compaction")
    clients = {urlsplit(a.get("advertise-client-urls", "")).netloc for a in members.values()}
    for name, svc in compose_agentenv(b).items():
        raw = (svc.get("environment") or {}).get("AGENTENV_ETCD")
        if raw is not None and set(str(raw).split(",")) != clients:
            problems.append(f"compose {name}: AGENTENV_ETCD={raw} is not the members {clients}")
    return problems


def check_compose_s3(b: Bundle) -> list[str]:
    problems: list[str] = []
    s3_ports = {
        name: flags(service_argv(svc)).get("s3.port")
        for name, svc in b.compose["services"].items()
        if "-s3" in service_argv(svc)
    }
    if not s3_ports:
        return ["compose: no SeaweedFS (`weed server -s3`) service"]
    for name, svc in compose_agentenv(b).items():
        raw = (svc.get("environment") or {}).get("AGENTENV_S3_ENDPOINT")
        if raw is not None and str(urlsplit(str(raw)).port) not in s3_ports.values():
            problems.append(f"compose {name}: AGENTENV_S3_ENDPOINT={raw} is no S3 port")
    return problems


def check_compose_nodes(b: Bundle) -> list[str]:
    problems: list[str] = []
    nodes = compose_role(b, "node")
    if len(nodes) < 2:
        problems.append(f"compose: {len(nodes)} node agents, expected 2 or more")
    seen: dict[str, dict[str, str]] = {"id": {}, "port": {}, "data": {}}
    ranges: dict[str, str] = {}
    for name, svc in nodes.items():
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        if not svc.get("privileged") or svc.get("network_mode") != "host":
            problems.append(f"compose {name}: a node agent needs privileged and the host network")
        if not any(str(d).startswith("/dev/kvm") for d in svc.get("devices", [])):
            problems.append(f"compose {name}: /dev/kvm is not passed")
        for setting in ("AGENTENV_ETCD", "AGENTENV_NODE_TOKEN", "AGENTENV_NODE_ID"):
            if setting not in env:
                problems.append(f"compose {name}: {setting} is not set")
        bind = env.get("AGENTENV_NODE_BIND", "127.0.0.1:7100")
        if "AGENTENV_NODE_URL" in env and urlsplit(env["AGENTENV_NODE_URL"]).port != port_of(bind):
            problems.append(f"compose {name}: AGENTENV_NODE_URL is not its bind's port")
        data = mounts_of(svc).get(env.get("AGENTENV_HOME", "/var/lib/agentenv"), "")
        for kind, value in (
            ("id", env.get("AGENTENV_NODE_ID", "")),
            ("port", str(port_of(bind))),
            ("data", data),
        ):
            if not value:
                problems.append(f"compose {name}: no {kind}")
            elif value in seen[kind]:
                problems.append(f"compose {name}: same {kind} {value} as {seen[kind][value]}")
            seen[kind][value] = name
        if "AGENTENV_SLOT_CIDR" not in env:
            problems.append(f"compose {name}: no AGENTENV_SLOT_CIDR (its own slot range)")
        else:
            ranges[name] = env["AGENTENV_SLOT_CIDR"]
        # The setup run it waits for builds into the same data dir, in the same slot range.
        deps = svc.get("depends_on") or {}
        for dep in deps:
            other = b.compose["services"].get(dep, {})
            if other and service_argv(other)[:1] == ["setup"]:
                oenv = {k: str(v) for k, v in (other.get("environment") or {}).items()}
                if mounts_of(other).get(oenv.get("AGENTENV_HOME", "")) != data:
                    problems.append(f"compose {dep}: sets up another data dir than {name}'s")
                if oenv.get("AGENTENV_SLOT_CIDR") != env.get("AGENTENV_SLOT_CIDR"):
                    problems.append(f"compose {dep}: another slot range than {name}'s")
    return problems + slot_range_problems("compose", ranges)


def check_compose_control(b: Bundle) -> list[str]:
    problems: list[str] = []
    planes = compose_role(b, "serve")
    if len(planes) < 2:
        problems.append(f"compose: {len(planes)} control planes, expected 2 or more")
    ports: dict[int, str] = {}
    for name, svc in planes.items():
        env = svc.get("environment") or {}
        for setting in ("AGENTENV_ETCD", "AGENTENV_NODE_TOKEN", "AGENTENV_BIND"):
            if setting not in env:
                problems.append(f"compose {name}: {setting} is not set")
        if svc.get("network_mode") != "host":
            problems.append(f"compose {name}: the proxy reaches slot addresses on the host")
        port = port_of(str(env.get("AGENTENV_BIND", ":8000")))
        if port in ports:
            problems.append(f"compose {name}: port {port} is {ports[port]}'s too")
        ports[port] = name
    return problems


def compose_listens(svc: Doc) -> set[int]:
    """Host ports a host-network service listens on (binds and `-*port=`/listen-url flags)."""
    ports: set[int] = set()
    for key, value in flags(service_argv(svc)).items():
        if key.endswith("port") and value.isdigit():
            ports.add(int(value))
        if key.startswith("listen-"):
            ports.update(p for u in value.split(",") if (p := urlsplit(u).port) is not None)
    env = svc.get("environment") or {}
    for setting in ("AGENTENV_BIND", "AGENTENV_NODE_BIND"):
        if setting in env:
            ports.add(port_of(str(env[setting])))
    return ports


def check_compose_ports(b: Bundle) -> list[str]:
    problems: list[str] = []
    owner: dict[int, str] = {}
    for name, svc in b.compose["services"].items():
        if svc.get("network_mode") != "host":
            continue
        for port in compose_listens(svc):
            if port in owner:
                problems.append(f"compose {name}: host port {port} is {owner[port]}'s too")
            owner[port] = name
    return problems


# -- the image ---------------------------------------------------------------------------------


def dockerfile_lines(text: str) -> list[str]:
    """Instructions with continuation lines joined, comments dropped."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    return [line.strip() for line in joined.splitlines() if line.strip()]


def check_dockerfile(b: Bundle) -> list[str]:
    problems: list[str] = []
    lines = dockerfile_lines(b.dockerfile)
    if not lines or not re.match(r"FROM debian:bookworm\S*$", lines[0]):
        problems.append("Dockerfile: the base is not Debian bookworm")
    copied: dict[str, str] = {}
    for line in lines:
        if line.startswith(("COPY ", "ADD ")):
            parts = [p for p in line.split()[1:] if not p.startswith("--")]
            *sources, dest = parts
            for source in sources:
                if not (REPO / source).exists():
                    problems.append(f"Dockerfile: COPY source {source} is not in the repository")
                copied[source] = dest
    installs = " ".join(line for line in lines if "apt-get install" in line).split()
    for package in HOST_PACKAGES:
        if package not in installs:
            problems.append(f"Dockerfile: host package {package} is not installed")
    if not any(re.search(r"pip install (--\S+ )*\.(\s|$)", line) for line in lines):
        problems.append("Dockerfile: agentenv is not pip-installed from the repository")
    entry = [line for line in lines if line.startswith("ENTRYPOINT ")]
    script = "deploy/agentenv-entrypoint.sh"
    if not entry or copied.get(script) not in yaml.safe_load(entry[-1].split(None, 1)[1]):
        problems.append(f"Dockerfile: the ENTRYPOINT is not {script}")
    if not re.search(r'^exec aenv "\$@"$', b.entrypoint, re.M):
        problems.append(f'{script}: does not end in `exec aenv "$@"`')
    return problems


def dockerfile_cmd(b: Bundle) -> list[str]:
    cmd = [line for line in dockerfile_lines(b.dockerfile) if line.startswith("CMD ")]
    return [str(a) for a in yaml.safe_load(cmd[-1].split(None, 1)[1])] if cmd else []


def all_argv(b: Bundle) -> list[tuple[str, list[str]]]:
    found = list(agent_argv(b))
    found += [(f"compose {n}", service_argv(s)) for n, s in compose_agentenv(b).items()]
    found.append(("Dockerfile CMD", dockerfile_cmd(b)))
    return found


def all_env_names(b: Bundle) -> set[str]:
    names = k8s_env_names(b)
    for svc in b.compose["services"].values():
        names.update(svc.get("environment") or {})
    return names


# -- the tests ---------------------------------------------------------------------------------

CHECKS: list[Callable[[Bundle], list[str]]] = [
    check_kustomization,
    check_k8s_refs,
    check_k8s_ports,
    check_k8s_etcd,
    check_k8s_node_agent,
    check_k8s_control,
    check_compose_refs,
    check_compose_etcd,
    check_compose_s3,
    check_compose_nodes,
    check_compose_control,
    check_compose_ports,
    check_dockerfile,
]


def test_every_document_loads(bundle: Bundle) -> None:
    kinds = {d["kind"] for _, d in bundle.k8s}
    assert {"StatefulSet", "DaemonSet", "Deployment", "Service", "Secret", "ConfigMap"} <= kinds
    for name, doc in bundle.k8s:
        assert doc.get("apiVersion") and doc.get("metadata", {}).get("name"), name
    assert bundle.compose["services"]


def test_known_env_names_are_collected() -> None:
    known = known_env_names()
    # Read in config.py, api/server.py and the CLI: the scan must see all three.
    assert {"AGENTENV_HOME", "AGENTENV_BIND", "AGENTENV_NODE_BIND", "AGENTENV_LOG_FORMAT"} <= known


def test_env_settings_are_read_by_agentenv(bundle: Bundle) -> None:
    assert check_env_names(all_env_names(bundle), known_env_names(), "deploy") == []


def test_no_unknown_setting_in_any_deploy_file() -> None:
    """Plain text too: the entrypoint script, the Dockerfile, comments and the README."""
    known = known_env_names()
    problems = []
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            names = set(ENV_TOKEN.findall(path.read_text()))
            problems += check_env_names(names, known, str(path.relative_to(REPO)))
    assert problems == []


def test_commands_exist(bundle: Bundle) -> None:
    runs = all_argv(bundle)
    assert {argv[0] for _, argv in runs if argv} >= {"node", "serve", "setup"}
    assert [p for where, argv in runs for p in cli_problems(where, argv)] == []


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_check_passes(bundle: Bundle, check: Callable[[Bundle], list[str]]) -> None:
    assert check(bundle) == []


# -- each check catches a broken copy ---------------------------------------------------------


def k8s_doc(b: Bundle, kind: str, name: str) -> Doc:
    return next(d for _, d in b.k8s if d["kind"] == kind and d["metadata"]["name"] == name)


def node_container(b: Bundle) -> Doc:
    return role(b, "node")[0][1]


def break_unknown_env(b: Bundle) -> None:
    node_container(b)["env"].append({"name": "AGENTENV_NOT_A_SETTING", "value": "1"})


def break_compose_env(b: Bundle) -> None:
    b.compose["services"]["node-1"]["environment"]["AGENTENV_NODE_BINDS"] = "x"


def break_missing_secret(b: Bundle) -> None:
    env = {e["name"]: e for e in node_container(b)["env"]}
    env["AGENTENV_NODE_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] = "agentenv-secret"


def break_missing_secret_key(b: Bundle) -> None:
    k8s_doc(b, "Secret", "agentenv-secrets")["stringData"].pop("node-token")


def break_missing_configmap(b: Bundle) -> None:
    b.k8s = [(f, d) for f, d in b.k8s if d["metadata"]["name"] != "agentenv-config"]


def break_missing_volume(b: Bundle) -> None:
    spec = pod_spec(role(b, "node")[0][0])
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "kvm"]


def break_service_target(b: Bundle) -> None:
    k8s_doc(b, "Service", "agentenv-api")["spec"]["ports"][0]["targetPort"] = "https"


def break_bind_port(b: Bundle) -> None:
    env = {e["name"]: e for e in role(b, "serve")[0][1]["env"]}
    env["AGENTENV_BIND"]["value"] = "0.0.0.0:8080"


def break_initial_cluster(b: Bundle) -> None:
    k8s_doc(b, "StatefulSet", "etcd")["spec"]["replicas"] = 5


def break_etcd_endpoint(b: Bundle) -> None:
    k8s_doc(b, "ConfigMap", "agentenv-config")["data"]["AGENTENV_ETCD"] += ",etcd-3.etcd:2379"


def break_host_network(b: Bundle) -> None:
    pod_spec(role(b, "node")[0][0]).pop("hostNetwork")


def break_privileged(b: Bundle) -> None:
    node_container(b)["securityContext"] = {}


def break_slot_overlap(b: Bundle) -> None:
    k8s_doc(b, "ConfigMap", "agentenv-slot-ranges")["data"]["node-b"] = "198.18.8.0/21"


def break_slot_outside(b: Bundle) -> None:
    b.compose["services"]["node-2"]["environment"]["AGENTENV_SLOT_CIDR"] = "10.0.0.0/20"


def break_node_command(b: Bundle) -> None:
    node_container(b)["args"] = ["nodes"]


def break_option(b: Bundle) -> None:
    b.compose["services"]["node-1-setup"]["command"] = ["setup", "--skip-package"]


def break_depends_on(b: Bundle) -> None:
    b.compose["services"]["control-1"]["depends_on"] = ["etcd-1", "etcd-4"]


def break_compose_initial_cluster(b: Bundle) -> None:
    b.compose["services"]["etcd-3"]["command"][0] = "--name=etcd-three"


def break_compose_node_id(b: Bundle) -> None:
    b.compose["services"]["node-2"]["environment"]["AGENTENV_NODE_ID"] = "node-1"


def break_compose_s3(b: Bundle) -> None:
    b.compose["services"]["control-2"]["environment"]["AGENTENV_S3_ENDPOINT"] = "http://x:9000"


def break_copy_source(b: Bundle) -> None:
    b.dockerfile = b.dockerfile.replace("COPY src ./src", "COPY source ./src")


def break_package(b: Bundle) -> None:
    b.dockerfile = b.dockerfile.replace(" nftables ", " ")


def break_kustomization(b: Bundle) -> None:
    b.kustomization["resources"].append("ingress.yaml")


def break_compose_volume(b: Bundle) -> None:
    b.compose["volumes"].pop("node-2-data")


def break_compose_port(b: Bundle) -> None:
    b.compose["services"]["control-2"]["environment"]["AGENTENV_BIND"] = "127.0.0.1:8001"


def break_env_order(b: Bundle) -> None:
    env = node_container(b)["env"]
    host_ip = next(e for e in env if e["name"] == "HOST_IP")
    env.remove(host_ip)
    env.append(host_ip)


def break_node_id_source(b: Bundle) -> None:
    env = {e["name"]: e for e in node_container(b)["env"]}
    env["AGENTENV_NODE_ID"].pop("valueFrom")
    env["AGENTENV_NODE_ID"]["value"] = "node-a"


def break_setup_data_dir(b: Bundle) -> None:
    volumes = b.compose["services"]["node-1-setup"]["volumes"]
    volumes[0] = "node-2-data:/var/lib/agentenv"


def break_entrypoint(b: Bundle) -> None:
    b.entrypoint = b.entrypoint.replace('exec aenv "$@"', 'exec aenv node "$@"')


BREAKAGES: list[tuple[Callable[[Bundle], None], Callable[[Bundle], list[str]], str]] = [
    (break_missing_secret, check_k8s_refs, "Secret agentenv-secret is not defined"),
    (break_missing_secret_key, check_k8s_refs, "has no key node-token"),
    (break_missing_configmap, check_k8s_refs, "ConfigMap agentenv-config is not defined"),
    (break_missing_volume, check_k8s_refs, "volume kvm is not defined"),
    (break_service_target, check_k8s_refs, "targetPort https"),
    (break_bind_port, check_k8s_ports, "AGENTENV_BIND=0.0.0.0:8080"),
    (break_etcd_endpoint, check_k8s_ports, "etcd-3.etcd:2379 is no StatefulSet member"),
    (break_initial_cluster, check_k8s_etcd, "--initial-cluster names"),
    (break_host_network, check_k8s_node_agent, "needs hostNetwork"),
    (break_privileged, check_k8s_node_agent, "needs privileged"),
    (break_missing_volume, check_k8s_node_agent, "/dev/kvm is not a hostPath mount"),
    (break_slot_overlap, check_k8s_node_agent, "slot ranges of node-b and node-a overlap"),
    (break_slot_outside, check_compose_nodes, "outside 198.18.0.0/15"),
    (break_depends_on, check_compose_refs, "depends_on etcd-4"),
    (break_compose_volume, check_compose_refs, "volume node-2-data"),
    (break_compose_initial_cluster, check_compose_etcd, "is not the members"),
    (break_compose_node_id, check_compose_nodes, "same id node-1"),
    (break_compose_s3, check_compose_s3, "is no S3 port"),
    (break_copy_source, check_dockerfile, "COPY source source"),
    (break_package, check_dockerfile, "host package nftables"),
    (break_compose_port, check_compose_control, "port 8001 is control-1's too"),
    (break_compose_port, check_compose_ports, "host port 8001 is control-1's too"),
    (break_env_order, check_k8s_refs, "$(HOST_IP) is not defined before"),
    (break_node_id_source, check_k8s_node_agent, "AGENTENV_NODE_ID must come from spec.nodeName"),
    (break_setup_data_dir, check_compose_nodes, "sets up another data dir than node-1's"),
    (break_entrypoint, check_dockerfile, "does not end in"),
    (break_kustomization, check_kustomization, "resource ingress.yaml does not exist"),
]


@pytest.mark.parametrize(
    ("breakage", "check", "expected"), BREAKAGES, ids=[b[0].__name__ for b in BREAKAGES]
)
def test_broken_copy_is_caught(
    bundle: Bundle,
    breakage: Callable[[Bundle], None],
    check: Callable[[Bundle], list[str]],
    expected: str,
) -> None:
    broken = copy.deepcopy(bundle)
    breakage(broken)
    problems = check(broken)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "breakage", [break_unknown_env, break_compose_env], ids=lambda f: f.__name__
)
def test_unknown_env_is_caught(bundle: Bundle, breakage: Callable[[Bundle], None]) -> None:
    broken = copy.deepcopy(bundle)
    breakage(broken)
    problems = check_env_names(all_env_names(broken), known_env_names(), "deploy")
    assert len(problems) == 1 and "is not a setting agentenv reads" in problems[0], problems


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (break_node_command, "has no command 'nodes'"),
        (break_option, "has no option --skip-package"),
    ],
    ids=["command", "option"],
)
def test_unknown_command_is_caught(
    bundle: Bundle, breakage: Callable[[Bundle], None], expected: str
) -> None:
    broken = copy.deepcopy(bundle)
    breakage(broken)
    problems = [p for where, argv in all_argv(broken) for p in cli_problems(where, argv)]
    assert any(expected in p for p in problems), problems


def test_subcommand_needed_is_caught() -> None:
    assert "needs a subcommand" in cli_problems("x", ["kernel"])[0]
    assert cli_problems("x", ["node", "ls"]) == []
