"""SDK scenarios for another e2b version than the venv's (e.g. 2.50.0, the last v1-route SDK).

Not collected by pytest: it runs in its own venv, against an envd you start.

    python -m venv /tmp/e2b250 && /tmp/e2b250/bin/pip install e2b==2.50.0
    .venv/bin/python -m agentenv.guest.envd --host 127.0.0.1 --port 49990 &
    E2B_DEBUG=true E2B_SANDBOX_URL=http://127.0.0.1:49990 E2B_API_KEY=x \
        /tmp/e2b250/bin/python tests/guest/envd/compat_other_sdk.py
"""

# ruff: noqa: SIM105
import os
import threading
import time

from e2b import FilesystemEventType, Sandbox
from e2b.exceptions import TimeoutException
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize

s = Sandbox.create()
r = s.commands.run("echo out; echo err >&2; whoami")
assert (r.stdout, r.stderr) == ("out\nuser\n", "err\n"), r
try:
    s.commands.run("exit 3")
    raise SystemExit("no raise")
except CommandExitException as e:
    assert e.exit_code == 3
h = s.commands.run("sleep 100", background=True)
assert s.commands.kill(h.pid)
try:
    h.wait()
except CommandExitException as e:
    assert e.exit_code == -1
assert not s.commands.kill(h.pid)
h = s.commands.run("cat", background=True, stdin=True)
s.commands.send_stdin(h.pid, "abc\n")
s.commands.close_stdin(h.pid)
assert h.wait().stdout == "abc\n"
h = s.commands.run("sleep 1; echo done", background=True)
h.disconnect()
assert s.commands.connect(h.pid).wait().stdout == "done\n"
try:
    s.commands.run("sleep 10", timeout=1)
    raise SystemExit("no timeout")
except TimeoutException:
    pass
d = f"/home/user/e2b250-{os.getpid()}"
s.files.write(f"{d}/a.txt", "hello")
assert s.files.read(f"{d}/a.txt") == "hello"
assert s.files.exists(f"{d}/a.txt") and not s.files.exists(f"{d}/nope")
assert s.files.make_dir(f"{d}/x") and not s.files.make_dir(f"{d}/x")
assert {e.name for e in s.files.list(d)} == {"a.txt", "x"}
w = s.files.watch_dir(d)
s.files.write(f"{d}/w.txt", "w")
time.sleep(0.5)
ev = w.get_new_events()
w.stop()
assert any(e.name == "w.txt" and e.type == FilesystemEventType.CREATE for e in ev), ev
s.files.write(f"{d}/m.txt", "m", metadata={"k": "v"})
assert s.files.get_info(f"{d}/m.txt").metadata == {"k": "v"}
s.files.remove(d)
p = s.pty.create(PtySize(24, 80))
out = bytearray()


def waiter():
    try:
        p.wait(on_pty=out.extend)
    except CommandExitException:
        pass


t = threading.Thread(target=waiter)
t.start()
s.pty.send_stdin(p.pid, b"echo P-$((3+4))\n")
for _ in range(100):
    if b"P-7" in out:
        break
    time.sleep(0.05)
s.pty.kill(p.pid)
t.join(5)
assert b"P-7" in out
print("e2b 2.50.0 scenarios OK")
