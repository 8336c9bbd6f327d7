"""libnftables in-process, inside a namespace this test makes (no VM, no nft/nsenter spawn)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.network import netns_socket, nft
from agentenv.network.errors import NetworkError

RULES = """
table netdev probe {
    counter hits {}
}
"""


@pytest.fixture
async def netns() -> AsyncIterator[str]:
    name = f"ae-nfttest-{os.getpid()}"
    await netns_socket.add_netns(name)
    try:
        yield name
    finally:
        await netns_socket.remove_netns(name)


async def test_apply_in_netns_with_sysctls_and_counters(netns: str) -> None:
    knob = Path("/proc/sys/net/ipv6/conf/all/disable_ipv6")
    host_before = await asyncio.to_thread(knob.read_text)
    await nft.apply(netns, RULES, {"net.ipv6.conf.all.disable_ipv6": "1"})
    assert await nft.counters(netns, "netdev", "probe") == {"hits": 0}
    # The sysctl is the namespace's (written from its thread), not the host's.
    assert (await netns_socket.run_in(netns, knob.read_text)).strip() == "1"
    assert await asyncio.to_thread(knob.read_text) == host_before
    # The table lives in the namespace only: the host has none of that name.
    with pytest.raises(NetworkError, match="No such file or directory"):
        nft.nft_run("list table netdev probe")
    # One buffer is one transaction: a bad line leaves the table as it was.
    with pytest.raises(NetworkError):
        await nft.apply(netns, "delete table netdev probe\nadd rule netdev probe nochain drop\n")
    assert await nft.counters(netns, "netdev", "probe") == {"hits": 0}


async def test_missing_netns_is_a_network_error() -> None:
    with pytest.raises(NetworkError, match="No such file"):
        await nft.apply("ae-nfttest-absent", RULES)


def test_a_transaction_refused_with_eintr_is_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel's EINTR for a batch cannot be made on demand; the batch it aborted can be
    # replayed whole, and any other refusal is not.
    calls: list[str] = []
    answers = ["nft: Error: Could not process rule: Interrupted system call", None]

    def once(text: str, json_output: bool) -> str:
        calls.append(text)
        answer = answers.pop(0) if answers else "nft: Error: Could not process rule: No such file"
        if answer is not None:
            raise NetworkError(answer)
        return "done"

    monkeypatch.setattr(nft, "_run_once", once)
    assert nft.nft_run("flush ruleset") == "done"
    assert calls == ["flush ruleset"] * 2
    calls.clear()
    with pytest.raises(NetworkError, match="No such file"):
        nft.nft_run("flush ruleset")
    assert len(calls) == 1
    calls.clear()
    answers[:] = ["nft: Error: Could not process rule: Interrupted system call"] * 5
    with pytest.raises(NetworkError, match="Interrupted"):
        nft.nft_run("flush ruleset")
    assert len(calls) == nft._EINTR_ATTEMPTS
