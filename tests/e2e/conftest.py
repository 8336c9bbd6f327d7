"""End-to-end modules share tests/api's module-scoped server (one real server process per
module) and its API client, instead of each writing them again."""

from api.conftest import api, server

__all__ = ["api", "server"]
