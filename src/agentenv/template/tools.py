"""The tools layer: a read-only ext4 drive with our init, envd and a self-contained Python.

The Python runtime is Debian's python3.11 with every shared library it needs and glibc's own
dynamic loader. It is started as ``ld-linux-x86-64.so.2 --library-path LIB python3.11`` and
finds its stdlib through a ``._pth`` file next to the interpreter, so it runs inside any
x86_64 rootfs (glibc, musl or none), sets no environment variables that children inherit, and
never looks at the rootfs's /usr.

Layout (mounted at /.agentenv in the guest)::

    /init                      tools-init (busybox sh), PID 1 before the pivot
    /bin/busybox, /bin/python  static busybox; the Python launcher
    /python/bin/python3.11     interpreter + python3.11._pth (and resize2fs, same loader)
    /python/lib/               ld-linux-x86-64.so.2 and the shared libraries
    /python/lib/python3.11/    the stdlib (no tests/idle/tkinter/ensurepip)
    /python/site-packages/     envd's pip requirements and the agentenv package (guest/ only)
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import agentenv
from agentenv.config import Settings
from agentenv.template import debian
from agentenv.template.cache import ArtifactCache, digest_files
from agentenv.template.commands import run
from agentenv.template.errors import BuildError
from agentenv.template.initramfs import BUSYBOX, GUEST_FILES, busybox_version
from agentenv.template.progress import ProgressFn, report

PYTHON = Path("/usr/bin/python3.11")
# Grows a sandbox's ext4 online when its disk is larger than the template's filesystem.
RESIZE2FS = Path("/sbin/resize2fs")
STDLIB = Path("/usr/lib/python3.11")
TOOLS_INIT = GUEST_FILES / "tools-init"
TOOLS_LABEL = "agentenv-tools"
GUEST_PREFIX = "/.agentenv"
PACKAGE_DIR = Path(agentenv.__file__).resolve().parent
REQUIREMENTS = PACKAGE_DIR / "guest" / "envd" / "requirements.txt"
FALLBACK_REQUIREMENTS = "uvicorn\nh11\nstarlette\nprotobuf\nconnectrpc\npython-multipart\n"

# Packages whose files end up in the Python runtime; their versions key its cache entry.
RUNTIME_PACKAGES = [
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libc6",
    "libbz2-1.0",
    "libcrypt1",
    "libdb5.3",
    "libexpat1",
    "libffi8",
    "libgssapi-krb5-2",
    "liblzma5",
    "libncursesw6",
    "libnsl2",
    "libreadline8",
    "libsqlite3-0",
    "libssl3",
    "libtinfo6",
    "libtirpc3",
    "libuuid1",
    "zlib1g",
    "e2fsprogs",
    "libext2fs2",
    "libcom-err2",
    # libgcc_s for the wheels' native extensions (Rust ones link it); see `populate_tree`.
    "libgcc-s1",
]
STDLIB_SKIP = {
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "config-3.11-x86_64-linux-gnu",
    "site-packages",
    "dist-packages",
    "sitecustomize.py",
    "EXTERNALLY-MANAGED",
}
DYNLOAD_SKIP = re.compile(r"^(_test|_ctypes_test|_xxtest|xxlimited|xxsubtype)")

LAUNCHER = f"""#!{GUEST_PREFIX}/bin/busybox sh
# Runs the tools Python through its own loader and libraries, whatever libc the rootfs has.
d=${{0%/bin/python}}
exec "$d/python/lib/ld-linux-x86-64.so.2" --library-path "$d/python/lib" \\
    "$d/python/bin/python3.11" "$@"
"""
# The runtime's glibc is Debian 12's 2.36: any wheel built for that or older fits.
WHEEL_PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (36, 35, 34, 31, 28, 27, 17)]
PTH = "../lib/python3.11\n../lib/python3.11/lib-dynload\n../site-packages\n"


def requirements_text() -> str:
    if REQUIREMENTS.is_file():
        return REQUIREMENTS.read_text()
    return FALLBACK_REQUIREMENTS


def runtime_inputs() -> dict[str, str]:
    versions = debian.installed_versions(RUNTIME_PACKAGES)
    for pkg in ("python3.11-minimal", "libpython3.11-stdlib", "libc6"):
        if versions[pkg] is None:
            raise BuildError(f"{pkg} is not installed (run `aenv setup`)")
    inputs = {f"pkg:{k}": v or "-" for k, v in versions.items()}
    inputs["recipe"] = digest_files(Path(__file__))
    return inputs


def ensure_runtime(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """The relocatable Python runtime tree (``<artifact>/python``)."""

    def build(out: Path) -> None:
        report(progress, "assembling the guest Python runtime")
        root = out / "python"
        (root / "bin").mkdir(parents=True)
        lib = root / "lib"
        lib.mkdir()
        shutil.copy2(PYTHON, root / "bin" / "python3.11")
        (root / "bin" / "python3.11._pth").write_text(PTH)
        shutil.copytree(
            STDLIB,
            lib / "python3.11",
            symlinks=False,
            ignore=_stdlib_ignore,
            ignore_dangling_symlinks=True,
        )
        shutil.copy2(RESIZE2FS, root / "bin" / "resize2fs")
        objects = [PYTHON, RESIZE2FS, *sorted((lib / "python3.11" / "lib-dynload").glob("*.so"))]
        copy_shared_libs(objects, lib)

    path, _ = ArtifactCache(settings.cache).ensure("pyruntime", runtime_inputs(), build)
    return path / "python"


def _stdlib_ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n in STDLIB_SKIP}
    if directory.endswith("lib-dynload"):
        skip |= {n for n in names if DYNLOAD_SKIP.match(n)}
    return skip


def copy_shared_libs(objects: list[Path], dest: Path) -> None:
    """Copy the loader and every library the objects link against (per ldd) into dest."""
    seen: set[str] = set()
    for obj in objects:
        out = run(["ldd", obj])
        for line in out.splitlines():
            m = re.match(r"\s*(\S+)\s+=>\s+(/\S+)", line)
            if m:
                name, path = m.group(1), Path(m.group(2))
            else:
                m = re.match(r"\s*(/\S*ld-linux[^\s]*)\s", line)
                if not m:
                    continue
                path = Path(m.group(1))
                name = path.name
            if name in seen or name.startswith("linux-vdso"):
                continue
            seen.add(name)
            shutil.copy2(path.resolve(), dest / name)
    if "ld-linux-x86-64.so.2" not in seen:
        raise BuildError("ldd did not report the dynamic loader ld-linux-x86-64.so.2")


def add_missing_libs(objects: list[Path], dest: Path, inside: Path) -> None:
    """Copy into `dest` what the objects link against (per ldd) that neither `dest` nor the
    objects' own bundled libraries (paths under `inside`, e.g. a wheel's ``*.libs``) have."""
    for obj in objects:
        if not obj.is_file() or obj.is_symlink():
            continue
        out = run(["ldd", obj])
        for line in out.splitlines():
            if "not found" in line:
                raise BuildError(f"{obj.name}: {line.strip()}")
            m = re.match(r"\s*(\S+)\s+=>\s+(/\S+)", line)
            if not m:
                continue
            name, path = m.group(1), Path(m.group(2))
            if (dest / name).exists() or path.resolve().is_relative_to(inside.resolve()):
                continue
            shutil.copy2(path.resolve(), dest / name)


def ensure_pydeps(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """envd's pip requirements installed for the guest (``<artifact>/site-packages``)."""
    reqs = requirements_text()
    inputs = {
        "requirements": reqs,
        "python": "3.11",
        "platforms": ",".join(WHEEL_PLATFORMS),
        "recipe": digest_files(Path(__file__)),
    }

    def build(out: Path) -> None:
        report(progress, "installing envd's Python packages for the guest")
        req_file = out / "requirements.txt"
        req_file.write_text(reqs)
        target = out / "site-packages"
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-compile",
                "--target",
                target,
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--implementation",
                "cp",
                "--abi",
                "cp311",
                *[arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)],
                "-r",
                req_file,
            ],
            timeout=1800,
        )
        for junk in target.glob("bin"):
            shutil.rmtree(junk)

    path, _ = ArtifactCache(settings.cache).ensure("pydeps", inputs, build)
    return path / "site-packages"


# Guest code that does not run from the tools layer: the code-interpreter server is installed
# into its own template (`template.code_interpreter`), so editing it rebuilds only that.
NOT_IN_TOOLS = frozenset({"interpreter", "__pycache__"})


def guest_sources() -> list[Path]:
    """The parts of our package the tools layer holds, and the only ones its key hashes: the
    package marker, `agentenv.ports` and `agentenv.guest` (which imports nothing else of ours;
    the `guest` import-linter contract holds it). No host-side code or setting goes in."""
    guest = PACKAGE_DIR / "guest"
    packed = sorted(p for p in guest.iterdir() if p.name not in NOT_IN_TOOLS)
    return [PACKAGE_DIR / "__init__.py", PACKAGE_DIR / "ports.py", *packed]


def tools_inputs(runtime: Path, pydeps: Path) -> dict[str, str]:
    return {
        "runtime": runtime.parent.name,
        "pydeps": pydeps.parent.name,
        "busybox": busybox_version(),
        "agentenv": digest_files(*guest_sources()),
        "init": digest_files(TOOLS_INIT),
        "recipe": digest_files(Path(__file__)),
    }


def ensure_tools_image(settings: Settings, progress: ProgressFn | None = None) -> Path:
    """The tools layer as a raw ext4 image, built from the runtime, deps and our sources."""
    runtime = ensure_runtime(settings, progress)
    pydeps = ensure_pydeps(settings, progress)
    inputs = tools_inputs(runtime, pydeps)

    def build(out: Path) -> None:
        report(progress, "building the tools layer")
        with tempfile.TemporaryDirectory(dir=settings.cache, prefix=".tools-") as scratch:
            tree = Path(scratch) / "tree"
            populate_tree(tree, runtime, pydeps)
            make_ext4(tree, out / "tools.ext4", TOOLS_LABEL)

    path, _ = ArtifactCache(settings.cache).ensure("tools", inputs, build)
    return path / "tools.ext4"


def populate_tree(tree: Path, runtime: Path, pydeps: Path) -> None:
    for d in ("bin", "dev", "proc", "sys", "mnt/root"):
        (tree / d).mkdir(parents=True)
    shutil.copy2(BUSYBOX, tree / "bin" / "busybox")
    shutil.copy2(TOOLS_INIT, tree / "init")
    os.chmod(tree / "init", 0o755)
    (tree / "bin" / "python").write_text(LAUNCHER)
    os.chmod(tree / "bin" / "python", 0o755)
    # Without an initramfs the kernel opens /dev/console on this drive before devtmpfs exists.
    os.mknod(tree / "dev" / "console", 0o600 | stat.S_IFCHR, os.makedev(5, 1))
    shutil.copytree(runtime, tree / "python", symlinks=True)
    site = tree / "python" / "site-packages"
    shutil.copytree(pydeps, site, symlinks=True)
    # The wheels' native extensions link against system libraries too (libgcc_s for Rust
    # ones, glibc's libdl/libpthread stubs). A Debian rootfs has them, a busybox or musl
    # image does not: ship them with the runtime.
    add_missing_libs(sorted(site.rglob("*.so*")), tree / "python" / "lib", tree)
    pkg = site / "agentenv"
    pkg.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for src in guest_sources():
        dest = pkg / src.relative_to(PACKAGE_DIR)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest, ignore=ignore)
        else:
            shutil.copy2(src, dest)
    # Byte-compile ahead: compiling at import time is slow under emulation and the drive is
    # read-only. unchecked-hash pycs stay valid whatever the file timestamps become.
    run(
        [PYTHON, "-m", "compileall", "-q", "-j0", "--invalidation-mode", "unchecked-hash", site],
        timeout=1800,
    )


def make_ext4(tree: Path, image: Path, label: str) -> None:
    used = int(run(["du", "-s", "--block-size=1M", tree]).split()[0])
    size_mb = used + used // 4 + 32
    # No journal: the drive is only ever mounted read-only.
    run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            label,
            "-O",
            "^has_journal",
            "-m",
            "0",
            "-d",
            tree,
            image,
            f"{size_mb}M",
        ],
        timeout=1800,
    )
