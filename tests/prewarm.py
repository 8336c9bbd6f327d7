"""Build, while scripts/test lints and type-checks, what the VM test modules would otherwise
wait for when they start: the run's seed data dir (`base` and its template snapshot, which
`prepare_home` clones: every worker's first VM module waits on it), the `docker` template's
image (a debootstrap of its own) and the `code-interpreter-v1` image (its wheels). On an
empty cache these are mostly downloads and package unpacking, which lint's minute of CPU
leaves room for.

Run as ``python tests/prewarm.py SEED_HOME``. The workers' own calls take the same locks
(the seed's lock file, the artifact cache's), so a test that starts first simply waits,
and a prewarm that failed is built again, with its error, by the test that needs it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from agentenv.config import Settings
from agentenv.template.code_interpreter import ensure_code_interpreter_image
from agentenv.template.datadir import ensure_seed
from agentenv.template.docker import ensure_docker_image


def main(seed: Path) -> None:
    t0 = time.monotonic()
    ensure_seed(seed)
    print(f"seed data dir ready in {time.monotonic() - t0:.1f}s", flush=True)
    t1 = time.monotonic()
    ensure_docker_image(Settings.from_env(), None)
    print(f"docker template image ready in {time.monotonic() - t1:.1f}s", flush=True)
    t2 = time.monotonic()
    ensure_code_interpreter_image(Settings.from_env(), None)
    print(f"code-interpreter image ready in {time.monotonic() - t2:.1f}s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
