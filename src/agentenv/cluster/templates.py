"""Templates as a control-plane replica of a cluster sees them.

Templates by name (`base`, built ones, `name:tag`) come from the replica's own catalog, as on
one server. A snapshot taken on some node (through the API, or a build's) is not in that
catalog: its id is passed on to the cluster, whose placement prefers the nodes holding it and
whose nodes fetch it from object storage when they lack it; an id no node and no bucket knows
is refused there (404), as an unknown template is here.
"""

from __future__ import annotations

from agentenv.contract.runtime import (
    SNAPSHOT_ID,
    TemplateInfo,
    TemplateSource,
    TemplateUnavailable,
)


class ClusterTemplates:
    def __init__(self, local: TemplateSource) -> None:
        self.local = local
        # The wrapped source's settings, where it has them (`api.templates` reads them).
        self.settings: object = getattr(local, "settings", None)

    def get(self, name: str) -> TemplateInfo:
        try:
            return self.local.get(name)
        except TemplateUnavailable:
            if not SNAPSHOT_ID.fullmatch(name):
                raise
        # Its shape is the snapshot's own (a restore keeps it); size, CPUs and memory here
        # are unknown (0): the request's values or the server's defaults are recorded.
        return TemplateInfo(name=name, size_mb=0, created_at=0.0, updated_at=0.0, cpu=0,
                            memory_mb=0)  # fmt: skip

    def list(self) -> list[TemplateInfo]:
        return self.local.list()

    def delete(self, name: str) -> bool:
        return self.local.delete(name)


def _check(t: ClusterTemplates) -> TemplateSource:
    return t
