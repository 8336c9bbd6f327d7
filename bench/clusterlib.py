"""bench/cluster.py's harness for the benches built on it (gateway, scaling), loaded once
under the name `bench_cluster`: as `cluster` it would shadow tests/cluster, the package of
the etcd harness it imports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_cluster", Path(__file__).resolve().parent / "cluster.py"
)
assert _spec is not None and _spec.loader is not None
bench_cluster = importlib.util.module_from_spec(_spec)
sys.modules["bench_cluster"] = bench_cluster  # its dataclasses look their module up
_spec.loader.exec_module(bench_cluster)
