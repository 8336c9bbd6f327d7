"""`node.admission`: capacity refused at once (with the numbers), starts beyond the
limit wait in arrival order in a bounded queue, and every exit releases what it held."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentenv.node.admission import HELD_FRESH_S, MIB, Admission, Limits, private_bytes
from agentenv.node.errors import NoCapacity

GIB = 1024 * MIB


@dataclass
class Sb:
    memory_mb: int = 512
    pid: int | None = None


def make(
    *,
    running: list[Sb] | None = None,
    available: int = 64 * GIB,
    held: int = 0,
    free: int = 100 * GIB,
    **limits: Any,
) -> Admission:
    rows = running if running is not None else []
    return Admission(
        Limits(**limits),
        lambda: rows,
        Path("/data"),
        available=lambda: available,
        held=lambda _pid: held,
        free_disk=lambda _path: free,
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fifo_in_arrival_order_and_no_overtaking() -> None:
    adm = make(max_starts=1)
    order: list[str] = []

    async def run(name: str) -> None:
        async with adm.start(name, 512):
            order.append(name)

    a = adm.start("A", 512)
    await a.__aenter__()
    order.append("A")
    tasks = []
    for name in "BCD":
        tasks.append(asyncio.create_task(run(name)))
        await settle()
    assert (adm.starting, adm.waiting, adm.reserved) == (1, 3, 4)
    # A's exit hands its slot to B, which has not run yet; E arriving now queues last.
    await a.__aexit__(None, None, None)
    async with adm.start("E", 512):
        order.append("E")
    await asyncio.gather(*tasks)
    assert order == ["A", "B", "C", "D", "E"]
    assert (adm.starting, adm.waiting, adm.reserved) == (0, 0, 0)


async def test_starts_run_up_to_the_limit() -> None:
    adm = make(max_starts=3)
    release = asyncio.Event()
    peak = 0

    async def run() -> None:
        nonlocal peak
        async with adm.start("x", 512):
            peak = max(peak, adm.starting)
            await release.wait()

    tasks = [asyncio.create_task(run()) for _ in range(7)]
    await settle()
    assert (adm.starting, adm.waiting, adm.reserved) == (3, 4, 7)
    release.set()
    await asyncio.gather(*tasks)
    assert peak == 3 and adm.starting == 0


async def test_queue_is_bounded() -> None:
    adm = make(max_starts=1, queue=2)
    release = asyncio.Event()

    async def run() -> None:
        async with adm.start("x", 512):
            await release.wait()

    tasks = [asyncio.create_task(run()) for _ in range(3)]
    await settle()
    with pytest.raises(NoCapacity) as info:
        async with adm.start("a create of 'base'", 512):
            pass
    assert info.value.resource == "start queue"
    assert info.value.retry_after_s >= 1
    assert "start queue full: 2 starts waiting behind 1 running" in str(info.value)
    assert "a create of 'base'" in str(info.value)
    release.set()
    await asyncio.gather(*tasks)
    # Once drained the queue takes starts again.
    async with adm.start("x", 512):
        pass


async def test_max_sandboxes_counts_running_and_admitted() -> None:
    adm = make(running=[Sb()], max_sandboxes=3, max_starts=1)
    release = asyncio.Event()

    async def run() -> None:
        async with adm.start("x", 512):
            await release.wait()

    # One runs, one starts (holds the slot), one waits: 3 of 3.
    tasks = [asyncio.create_task(run()) for _ in range(2)]
    await settle()
    with pytest.raises(NoCapacity) as info:
        async with adm.start("a create of 'base'", 512):
            pass
    assert info.value.resource == "sandboxes"
    assert "no capacity: 3 of 3 sandboxes in use" in str(info.value)
    assert info.value.retry_after_s > 0
    release.set()
    await asyncio.gather(*tasks)
    # A fork of 3 needs 3 more: 1 running + 3 > 3.
    with pytest.raises(NoCapacity, match=r"1 of 3 sandboxes in use .* needs 3 more"):
        async with adm.start("a fork", 512, count=3):
            pass
    async with adm.start("a fork", 512, count=2):
        assert adm.reserved == 2


async def test_network_slots() -> None:
    adm = make(running=[Sb(), Sb()], max_slots=2)
    with pytest.raises(NoCapacity, match="2 of 2 network slots in use") as info:
        async with adm.start("x", 512):
            pass
    assert info.value.resource == "network slots"


async def test_memory_counts_what_sandboxes_may_still_grow_into() -> None:
    # Two running 512 MB sandboxes holding 100 MiB each may grow by 2 x (512 + 128 - 100)
    # = 1080 MiB; 10 GiB available - 1080 - 256 kept free = 8904 MiB for new ones of 640.
    running = [Sb(pid=1), Sb(pid=2)]
    adm = make(
        running=running,
        available=10 * GIB,
        held=100 * MIB,
        min_free_memory_mb=256,
        overhead_mb=128,
        max_starts=100,
    )
    async with adm.start("a fork", 512, count=13):
        pass
    with pytest.raises(NoCapacity) as info:
        async with adm.start("a fork", 512, count=14):
            pass
    msg = str(info.value)
    assert info.value.resource == "memory"
    assert "needs 8960 MiB (14 x 512 MB + 128 MiB VMM overhead), 8904 MiB left" in msg
    assert "10240 MiB available, 1080 MiB of it for 2 running or starting" in msg
    # Admitted starts count in full while they wait or start.
    release = asyncio.Event()

    async def hold() -> None:
        async with adm.start("x", 512, count=10):
            await release.wait()

    task = asyncio.create_task(hold())
    await settle()
    with pytest.raises(NoCapacity, match="host memory"):
        async with adm.start("x", 512, count=4):
            pass
    release.set()
    await task


async def test_disk_minimum() -> None:
    adm = make(free=500 * MIB, min_free_disk_mb=1024)
    with pytest.raises(NoCapacity) as info:
        async with adm.start("a create of 'base'", 512):
            pass
    assert info.value.resource == "disk"
    assert "500 MiB free in the data dir /data, below the 1024 MiB minimum" in str(info.value)


async def test_exceptions_release_everything() -> None:
    adm = make(max_starts=1, max_sandboxes=1)
    for _ in range(3):
        with pytest.raises(RuntimeError):
            async with adm.start("x", 512):
                raise RuntimeError("boot failed")
        assert (adm.starting, adm.waiting, adm.reserved) == (0, 0, 0)


async def test_cancelled_waiter_leaves_the_queue() -> None:
    adm = make(max_starts=1, queue=2)
    release = asyncio.Event()
    order: list[str] = []

    async def run(name: str) -> None:
        async with adm.start(name, 512):
            order.append(name)
            await release.wait()

    a = asyncio.create_task(run("A"))
    await settle()
    b = asyncio.create_task(run("B"))
    await settle()
    c = asyncio.create_task(run("C"))
    await settle()
    assert adm.waiting == 2 and adm.reserved == 3
    b.cancel()
    await settle()
    assert b.cancelled() and adm.waiting == 1 and adm.reserved == 2
    # Its place is free again: the queue takes one more.
    d = asyncio.create_task(run("D"))
    await settle()
    assert adm.waiting == 2
    release.set()
    await asyncio.gather(a, c, d)
    assert order == ["A", "C", "D"]
    assert (adm.starting, adm.waiting, adm.reserved) == (0, 0, 0)


async def test_waiter_cancelled_as_it_is_handed_the_slot_passes_it_on() -> None:
    adm = make(max_starts=1)
    order: list[str] = []

    async def run(name: str) -> None:
        async with adm.start(name, 512):
            order.append(name)

    a = adm.start("A", 512)
    await a.__aenter__()
    b = asyncio.create_task(run("B"))
    c = asyncio.create_task(run("C"))
    await settle()
    await a.__aexit__(None, None, None)  # hands the slot to B, which has not run since
    b.cancel()
    await asyncio.gather(c)
    assert b.cancelled()
    assert order == ["C"]
    assert (adm.starting, adm.waiting, adm.reserved) == (0, 0, 0)


async def test_cancelled_body_releases() -> None:
    adm = make(max_starts=1)
    started = asyncio.Event()

    async def run() -> None:
        async with adm.start("x", 512):
            started.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(run())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (adm.starting, adm.waiting, adm.reserved) == (0, 0, 0)
    async with asyncio.timeout(1):
        async with adm.start("x", 512):
            pass


async def test_retry_hint_follows_measured_starts() -> None:
    adm = make(max_starts=1, queue=1)
    release = asyncio.Event()

    async def run() -> None:
        async with adm.start("x", 512):
            await release.wait()

    tasks = [asyncio.create_task(run()) for _ in range(2)]
    await settle()
    with pytest.raises(NoCapacity) as info:
        async with adm.start("x", 512):
            pass
    # Two ahead at the assumed 2 s per start, one at a time.
    assert info.value.retry_after_s == 4
    release.set()
    await asyncio.gather(*tasks)


class _RefusingNode:
    """Just enough of `Node` for `NodeRuntime` to translate what its calls raise."""

    def __init__(self, home: Path, exc: BaseException) -> None:
        self.settings = type("S", (), {"home": home})()
        self.exc = exc

    async def create(self, *_: object, **__: object) -> object:
        raise self.exc

    async def pause(self, *_: object) -> None:
        raise self.exc


async def test_runtime_maps_refusals_to_503_and_full_disks_to_507(tmp_path: Path) -> None:
    import errno

    from agentenv.contract.errors import InsufficientStorage, Unavailable
    from agentenv.contract.runtime import SandboxSpec
    from agentenv.node.errors import BootFailed
    from agentenv.node.runtime import NodeRuntime

    def runtime(exc: BaseException) -> NodeRuntime:
        return NodeRuntime(None, _RefusingNode(tmp_path, exc))  # type: ignore[arg-type]

    refusal = NoCapacity("no capacity: 2 of 2 sandboxes", resource="sandboxes", retry_after_s=7)
    with pytest.raises(Unavailable) as busy:
        await runtime(refusal).create(SandboxSpec("i" + "0" * 19, "base", 1, 512))
    assert (busy.value.status, busy.value.retry_after) == (503, 7)
    assert busy.value.message == "no capacity: 2 of 2 sandboxes"

    enospc = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(InsufficientStorage) as full:
        await runtime(enospc).pause("i1")
    assert full.value.status == 507 and str(tmp_path) in full.value.message
    # A tool's failure that says so (qemu-img, QEMU), wrapped by the node.
    try:
        raise RuntimeError("qemu-img: error while writing: No space left on device")
    except RuntimeError as tool:
        wrapped = BootFailed("sandbox i1: create failed")
        wrapped.__cause__ = tool
    with pytest.raises(InsufficientStorage):
        await runtime(wrapped).create(SandboxSpec("i" + "0" * 19, "base", 1, 512))
    # Anything else passes unchanged.
    with pytest.raises(BootFailed):
        await runtime(BootFailed("envd not healthy")).create(
            SandboxSpec("i" + "0" * 19, "base", 1, 512)
        )


# -- waiting for capacity (a burst queues instead of failing) -----------------------------------


async def test_a_start_that_does_not_fit_waits_for_a_sandbox_to_end() -> None:
    rows = [Sb(), Sb()]
    adm = make(running=rows, max_sandboxes=2, capacity_wait_s=30.0)
    admitted = asyncio.Event()

    async def start() -> None:
        async with adm.start("late", 512):
            admitted.set()

    task = asyncio.create_task(start())
    await settle()
    assert adm.waiting_for_capacity == 1 and not admitted.is_set()
    rows.pop()
    adm.notify()
    await asyncio.wait_for(task, 5)
    assert admitted.is_set()
    assert (adm.waiting_for_capacity, adm.reserved) == (0, 0)


async def test_capacity_waiters_keep_arrival_order_and_the_head_is_not_overtaken() -> None:
    rows = [Sb(memory_mb=1024)]
    adm = make(running=rows, max_sandboxes=2, capacity_wait_s=30.0)
    # A fork of 2 does not fit (1 running of 2); a single start behind it would, but waits.
    order: list[str] = []

    async def start(name: str, count: int) -> None:
        async with adm.start(name, 512, count):
            order.append(name)

    big = asyncio.create_task(start("fork of 2", 2))
    await settle()
    small = asyncio.create_task(start("one", 1))
    await settle()
    assert adm.waiting_for_capacity == 2 and order == []
    rows.clear()
    adm.notify()
    await asyncio.wait_for(asyncio.gather(big, small), 5)
    assert order == ["fork of 2", "one"]


async def test_the_wait_ends_in_no_capacity_naming_the_resource_and_the_wait() -> None:
    adm = make(running=[Sb()], max_sandboxes=1, capacity_wait_s=0.2)
    with pytest.raises(NoCapacity) as err:
        async with adm.start("a create", 512):
            pass
    assert err.value.resource == "sandboxes"
    assert "waited 0s for capacity" in str(err.value) and "1 of 1 sandboxes" in str(err.value)
    assert (adm.waiting_for_capacity, adm.reserved) == (0, 0)


async def test_a_full_disk_is_refused_at_once_even_with_a_wait() -> None:
    adm = make(free=10 * MIB, capacity_wait_s=30.0)
    with pytest.raises(NoCapacity) as err:
        async with asyncio.timeout(5), adm.start("a create", 512):
            pass
    assert err.value.resource == "disk"


async def test_a_cancelled_head_lets_the_next_waiter_in() -> None:
    rows = [Sb()]
    adm = make(running=rows, max_sandboxes=1, capacity_wait_s=30.0)
    first = asyncio.create_task(adm.start("first", 512).__aenter__())
    await settle()

    async def second_start() -> None:
        async with adm.start("second", 512):
            pass

    second = asyncio.create_task(second_start())
    await settle()
    assert adm.waiting_for_capacity == 2
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert adm.waiting_for_capacity == 1
    rows.clear()
    # No notify: the head's poll finds the freed place by itself.
    await asyncio.wait_for(second, 5)
    assert (adm.waiting_for_capacity, adm.reserved) == (0, 0)


def test_private_bytes_reads_anonymous_and_shared_memory_of_a_process() -> None:
    fields = {}
    with open(f"/proc/{os.getpid()}/status") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            fields[name] = value
    expected = sum(int(fields[f].split()[0]) * 1024 for f in ("RssAnon", "RssShmem"))
    # This process may touch a few pages in between.
    assert abs(private_bytes(os.getpid()) - expected) < 4 * MIB
    assert private_bytes(2**22 + 7) == 0  # above pid_max: no such process


async def test_a_sandboxs_held_memory_is_read_once_per_window_and_anew_for_a_new_one() -> None:
    """Each check (a create, a published load) counts every running sandbox's held memory:
    read at most once per HELD_FRESH_S, not per check (#23)."""
    reads: list[int] = []
    now = [0.0]
    running = [Sb(pid=1), Sb(pid=2)]

    def held(pid: int) -> int:
        reads.append(pid)
        return 100 * MIB

    adm = Admission(
        Limits(max_starts=100),
        lambda: running,
        Path("/data"),
        available=lambda: 64 * GIB,
        held=held,
        free_disk=lambda _path: 100 * GIB,
        clock=lambda: now[0],
    )
    for _ in range(3):
        async with adm.start("a create", 512):
            pass
    free_mb, _slots = adm.headroom()
    assert sorted(reads) == [1, 2]
    # 64 GiB - 2 x (512 + 128 - 100) MiB - 256 kept free.
    assert free_mb == 64 * 1024 - 2 * 540 - 256
    now[0] += HELD_FRESH_S
    adm.headroom()
    assert sorted(reads) == [1, 1, 2, 2]
    # Pid 1 now another sandbox's (the first ended): read at once, not taken from before.
    running[0] = Sb(pid=1)
    adm.headroom()
    assert reads[4:] == [1]
