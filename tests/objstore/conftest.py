"""Fixtures: one SeaweedFS per test module, a fresh bucket and store per test."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agentenv.objstore import ObjectStore
from agentenv.objstore.bucket import MIN_PART_SIZE

from .seaweed import SeaweedFS

# The smallest part S3 takes, so a few MiB make a multipart upload of several parts.
PART = MIN_PART_SIZE


@pytest.fixture(scope="module")
def seaweed() -> Iterator[SeaweedFS]:
    with SeaweedFS() as sw:
        yield sw


@pytest.fixture
async def store(seaweed: SeaweedFS, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    bucket = "t-" + secrets.token_hex(6)
    async with ObjectStore(
        seaweed.config(bucket),
        state_dir=tmp_path / "objstore-state",
        part_size=PART,
        call_timeout_s=30.0,
    ) as s:
        await s.ensure_bucket()
        yield s
