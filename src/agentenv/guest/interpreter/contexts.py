"""The contexts the server holds, the languages it can start, and the default per language.

Languages: `python` (ipykernel) and `bash` (bash_kernel) are built in: their kernel commands use
the server's own interpreter, so they need no installed kernelspec. Any other language works when
a Jupyter kernelspec of that name is installed in the image (upstream's names: `javascript`,
`r`, `java`; `typescript` runs on the `javascript` kernel), like upstream, whose Jupyter server
starts the kernel named after the language. A language with no kernel is a 400.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from .kernel import Kernel, Settings

log = logging.getLogger(__name__)

HOOK = str(Path(__file__).with_name("startup_hook.py"))


class UnknownLanguage(ValueError):
    """No kernel exists for the language asked for."""


def normalize_language(language: str | None) -> str:
    """Upstream's spelling rules: none -> python, case and blanks ignored, js/ts aliases."""
    if not language:
        return "python"
    language = language.strip().lower()
    return {"js": "javascript", "ts": "typescript"}.get(language, language)


def _builtin_specs() -> dict[str, KernelSpec]:
    python = KernelSpec(
        argv=[
            sys.executable,
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
            f"--IPKernelApp.exec_files={HOOK}",
            "--InteractiveShell.colors=nocolor",
            "--PlainTextFormatter.max_seq_length=0",
            "--HistoryManager.enabled=False",
        ],
        display_name="Python 3",
        language="python",
        interrupt_mode="signal",
    )
    bash = KernelSpec(
        argv=[sys.executable, "-m", "bash_kernel", "-f", "{connection_file}"],
        display_name="Bash",
        language="bash",
        interrupt_mode="signal",
    )
    # Names of their own: jupyter_client renames a kernel called "python" to "python3".
    return {"python": python, "bash": bash}


BUILTIN_PREFIX = "builtin-"


class Specs(KernelSpecManager):
    """Built-in specs first, then whatever kernelspecs the image has installed."""

    builtin: dict[str, KernelSpec] = {}

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        builtin = kernel_name.removeprefix(BUILTIN_PREFIX)
        if kernel_name.startswith(BUILTIN_PREFIX) and builtin in self.builtin:
            return self.builtin[builtin]
        return super().get_kernel_spec(kernel_name)

    def kernel_for(self, language: str) -> str:
        """The kernel name for a (normalized) language; UnknownLanguage if there is none."""
        name = "javascript" if language == "typescript" else language
        if name in self.builtin:
            return BUILTIN_PREFIX + name
        try:
            super().get_kernel_spec(name)
        except NoSuchKernel:
            raise UnknownLanguage(
                f"no kernel for language {language!r}; available: {', '.join(self.languages())}"
            ) from None
        return name

    def languages(self) -> list[str]:
        installed = set(self.find_kernel_specs()) - {"python3"}
        return sorted(set(self.builtin) | installed)


class Contexts:
    """Every context by id, plus the default context of each language (made on first use)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.specs = Specs()
        self.specs.builtin = _builtin_specs()
        self.by_id: dict[str, Kernel] = {}
        self.defaults: dict[str, str] = {}
        self._default_lock = asyncio.Lock()

    async def create(self, language: str, cwd: str) -> Kernel:
        """Start a new context; UnknownLanguage or ValueError (bad cwd) for bad input."""
        spec = self.specs.kernel_for(language)
        if not os.path.isabs(cwd):
            raise ValueError(f"cwd {cwd!r} is not an absolute path")
        if not await asyncio.to_thread(os.path.isdir, cwd):
            raise ValueError(f"cwd {cwd!r} is not a directory")
        kernel = Kernel(language, cwd, spec, self.specs, self.settings)
        await kernel.start()
        self.by_id[kernel.id] = kernel
        log.info("context %s (%s) started in %s", kernel.id, language, cwd)
        return kernel

    async def default(self, language: str) -> Kernel:
        """The language's default context, started now if it has none yet (or it was removed)."""
        async with self._default_lock:
            kid = self.defaults.get(language)
            if kid is not None and kid in self.by_id:
                return self.by_id[kid]
            kernel = await self.create(language, self.settings.default_cwd)
            self.defaults[language] = kernel.id
            return kernel

    async def remove(self, kernel: Kernel) -> None:
        self.by_id.pop(kernel.id, None)
        for language, kid in list(self.defaults.items()):
            if kid == kernel.id:
                del self.defaults[language]
        await kernel.shutdown()

    async def close(self) -> None:
        kernels = list(self.by_id.values())
        self.by_id.clear()
        self.defaults.clear()
        await asyncio.gather(*(k.shutdown() for k in kernels), return_exceptions=True)
