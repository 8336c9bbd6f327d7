"""The `docker` template's recipe: which kernel modules it ships, and what keys its build.

Building it needs the Debian mirror; tests/e2e/test_docker_template.py does that and boots it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.template import docker
from agentenv.template.errors import BuildError


def _module_tree(root: Path, dep_lines: list[str], builtin: list[str]) -> Path:
    root.mkdir(parents=True)
    (root / "modules.dep").write_text("".join(f"{line}\n" for line in dep_lines))
    (root / "modules.builtin").write_text("".join(f"{b}\n" for b in builtin))
    return root


def _full_tree(root: Path, extra: list[str] | None = None) -> Path:
    nf = "kernel/net/netfilter"
    lines = [
        f"{nf}/nf_tables.ko: kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko",
        f"{nf}/nfnetlink.ko:",
        "kernel/lib/libcrc32c.ko:",
        "kernel/net/ipv4/netfilter/iptable_nat.ko: kernel/net/netfilter/nf_nat.ko",
        f"{nf}/nf_nat.ko:",
        "kernel/net/ipv6/netfilter/ip6_tables.ko:",
        "kernel/net/bridge/br_netfilter.ko: kernel/net/bridge/bridge.ko",
        "kernel/net/bridge/bridge.ko: kernel/net/802/stp.ko kernel/net/llc/llc.ko",
        "kernel/net/802/stp.ko: kernel/net/llc/llc.ko",
        "kernel/net/llc/llc.ko:",
        "kernel/fs/overlayfs/overlay.ko:",
        "kernel/drivers/net/veth.ko:",
        "kernel/drivers/net/macvlan.ko:",
        "kernel/drivers/net/ipvlan/ipvlan.ko:",
        "kernel/drivers/net/vxlan/vxlan.ko: kernel/net/ipv4/udp_tunnel.ko",
        "kernel/net/ipv4/udp_tunnel.ko:",
        "kernel/drivers/net/dummy.ko:",
        "kernel/net/8021q/8021q.ko:",
        "kernel/fs/btrfs/btrfs.ko: kernel/lib/libcrc32c.ko",
        "kernel/sound/unrelated.ko:",
        *(extra or []),
    ]
    # tun is built into this kernel: listed in modules.builtin, not in modules.dep.
    return _module_tree(root, lines, ["kernel/drivers/net/tun.ko"])


def test_module_closure_takes_the_directories_the_names_and_their_dependencies(
    tmp_path: Path,
) -> None:
    found = docker.module_closure(_full_tree(tmp_path / "m"))
    # Dependencies outside the chosen directories come along.
    assert {"kernel/lib/libcrc32c.ko", "kernel/net/llc/llc.ko", "kernel/net/802/stp.ko"} <= found
    assert "kernel/net/ipv4/udp_tunnel.ko" in found
    assert {"kernel/fs/overlayfs/overlay.ko", "kernel/drivers/net/veth.ko"} <= found
    assert "kernel/net/ipv4/netfilter/iptable_nat.ko" in found
    # Nothing the container features do not need.
    assert "kernel/fs/btrfs/btrfs.ko" not in found
    assert "kernel/sound/unrelated.ko" not in found


def test_module_closure_refuses_a_kernel_without_a_needed_module(tmp_path: Path) -> None:
    tree = _full_tree(tmp_path / "m")
    text = (tree / "modules.dep").read_text()
    (tree / "modules.dep").write_text(
        "".join(ln + "\n" for ln in text.splitlines() if "veth" not in ln)
    )
    with pytest.raises(BuildError, match="veth"):
        docker.module_closure(tree)
    no_overlay = _module_tree(
        tmp_path / "n",
        [ln for ln in text.splitlines() if "overlayfs" not in ln],
        ["kernel/drivers/net/tun.ko"],
    )
    with pytest.raises(BuildError, match="overlayfs"):
        docker.module_closure(no_overlay)


def test_build_key_follows_the_kernel_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def kernel(version: str) -> dict[str, str]:
        return {"package": f"linux-image-{version}-cloud-amd64", "version": version}

    monkeypatch.setattr(docker, "debian_kernel_inputs", lambda: kernel("6.1.0-50"))
    first = docker.docker_inputs()
    monkeypatch.setattr(docker, "debian_kernel_inputs", lambda: kernel("6.1.0-57"))
    second = docker.docker_inputs()
    assert first["kernel"] != second["kernel"]
    assert "6.1.0-57" in second["kernel"]
    assert second["suite"] == "trixie"
    assert {"docker.io", "docker-cli", "docker-compose", "iptables"} <= set(
        second["packages"].split(",")
    )
