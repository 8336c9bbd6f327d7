"""The `aenv` command line: host setup, diagnosis, the server and the sandbox client commands.

Heavy imports happen inside the commands so `aenv --help` and client commands start fast.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import typer
from rich.console import Console

from agentenv.config import Settings

app = typer.Typer(
    name="aenv",
    help="agentenv: microVM sandboxes for AI agents, driven by the E2B SDK.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
kernel_app = typer.Typer(help="Guest kernels.", no_args_is_help=True)
app.add_typer(kernel_app, name="kernel")

console = Console(stderr=True)


@app.command()
def setup(
    skip_packages: bool = typer.Option(
        False, "--skip-packages", help="Do not install missing Debian packages."
    ),
    with_test_tools: bool = typer.Option(
        False,
        "--with-test-tools",
        help="Also install what the test suite runs: node and npm (the JS SDK tests).",
    ),
    with_docker: bool = typer.Option(
        False,
        "--with-docker",
        help="Also build the `docker` template: Docker Engine and Compose v2 (Debian trixie).",
    ),
    with_code_interpreter: bool = typer.Option(
        False,
        "--with-code-interpreter",
        help="Also build the `code-interpreter-v1` template (alias `code-interpreter`): the "
        "E2B code-interpreter server with Python and bash kernels, numpy, pandas, matplotlib.",
    ),
) -> None:
    """Install host packages; build the guest kernel, tools layer and `base` template (and
    with --with-docker the `docker` template, 1-1.5 min more on a cold cache; with
    --with-code-interpreter `code-interpreter-v1`, about a minute more, which a create that
    names it otherwise builds on first use).

    Everything is cached by its inputs, so a second run is a cache hit that takes seconds.
    """
    from agentenv.cli.progress import step_progress
    from agentenv.hostdeps import ensure_host_packages, ensure_test_commands
    from agentenv.snapshot import ensure_template_snapshot
    from agentenv.template import code_interpreter, docker
    from agentenv.template.artifacts import ensure_all
    from agentenv.template.rootfs import ensure_base
    from agentenv.vmm.ramshim import ensure_ram_shim

    settings = Settings.from_env()
    started = time.monotonic()
    with step_progress(console) as progress:
        extra = docker.HOST_PACKAGES if with_docker else None
        installed = [] if skip_packages else ensure_host_packages(progress, extra=extra)
        if with_test_tools and not skip_packages:
            installed += ensure_test_commands(progress)
        artifacts = ensure_all(settings, progress)
        shim = ensure_ram_shim(settings.cache, progress)
        template = ensure_base(settings, progress)
        templates = [template]
        if with_docker:
            templates.append(docker.ensure_docker(settings, progress))
        if with_code_interpreter:
            templates.append(code_interpreter.ensure_code_interpreter(settings, progress))
        snapshots = []
        if settings.snapshots:
            # Templates are snapshots: boot each once in the default shape and capture it,
            # so the first sandbox is a resume, not a boot.
            for tpl in templates:
                progress(f"capturing the {tpl.name} template snapshot")
                snapshots.append(
                    asyncio.run(
                        ensure_template_snapshot(
                            settings, tpl.name, settings.default_memory_mb, settings.default_cpu
                        )
                    )
                )
    elapsed = time.monotonic() - started
    if installed:
        console.print(f"installed packages: {' '.join(installed)}")
    console.print(f"kernel: {artifacts.kernel} ({artifacts.kernel_kind})")
    console.print(f"tools layer: {artifacts.tools_image}")
    console.print(f"RAM preload library: {shim}")
    for tpl in templates:
        console.print(f"template {tpl.name}: {len(tpl.layers)} layer(s), {tpl.size_mb} MB")
    for snapshot in snapshots:
        console.print(f"template snapshot: {snapshot.id} ({', '.join(snapshot.names)})")
    console.print(f"setup finished in {elapsed:.1f} s")


@kernel_app.command("build")
def kernel_build() -> None:
    """Compile the minimal microVM kernel from Debian's linux-source (about 10 minutes on 2
    cores). Once built it is preferred over Debian's cloud kernel."""
    from agentenv.cli.progress import step_progress
    from agentenv.template.kernel_build import build_custom

    settings = Settings.from_env()
    with step_progress(console) as progress:
        path = build_custom(settings, progress)
    console.print(f"kernel: {path}")


@app.command()
def doctor() -> None:
    """Show which accelerator sandboxes use and why, and every missing prerequisite."""
    from agentenv.cli.doctor import run_doctor

    raise typer.Exit(run_doctor(Settings.from_env(), console))


def _register_optional() -> None:
    # The control plane registers `serve` and the client commands; the foundation works
    # without it, so a missing module is not an error here.
    try:
        from agentenv.cli.client import client_app
    except ImportError:
        return
    app.add_typer(client_app)
    from agentenv.cli.node import node_app

    app.add_typer(node_app, name="node")


_register_optional()


def main() -> None:
    """Entry point: every failure becomes one readable line and a non-zero exit."""
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("AGENTENV_DEBUG"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
        sys.exit(1)
