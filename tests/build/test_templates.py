"""`name` / `name:tag` resolution of built templates (`build.templates`), on records and an
in-memory snapshot repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.build.templates import (
    DEFAULT_TAG,
    BadTag,
    TagNotFound,
    clean_tags,
    split_name,
)
from agentenv.contract.runtime import TemplateUnavailable

from .fakes import FakeCatalog, FakeRepo, add_build, built_templates


def test_split_name_follows_e2b() -> None:
    assert split_name("app") == ("app", None)
    assert split_name("app:v2") == ("app", "v2")
    assert split_name("app:V2 ") == ("app", "v2")
    # `name:default` is `name`.
    assert split_name("app:default") == ("app", None)
    assert split_name("app:Default") == ("app", None)


def test_clean_tags() -> None:
    assert clean_tags(["V1", "v1", "prod", " x.y_z-1 "]) == ["v1", "prod", "x.y_z-1"]
    assert clean_tags([]) == []
    for bad in ("", "a b", "a:b", "ü", "x" * 129):
        with pytest.raises(BadTag):
            clean_tags([bad])
    with pytest.raises(BadTag, match="UUID"):
        clean_tags(["2f1b7c54-8d0e-4a53-9a53-2d6d1b2f0c11"])


async def test_name_resolves_the_default_tag_and_tags_name_builds(tmp_path: Path) -> None:
    repo = FakeRepo()
    built = built_templates(tmp_path, FakeCatalog(["base"]), repo)
    v1 = add_build(built, repo, "app", [DEFAULT_TAG])
    v2 = add_build(built, repo, "app", ["v2"])

    got = await built.get("app")
    assert got.ref == v1.snapshot_id
    assert (got.name, got.template_id) == ("app", "app")
    assert (got.cpu, got.memory_mb, got.size_mb) == (2, 768, 100)
    assert (await built.get("app:default")).ref == v1.snapshot_id
    assert (await built.get("app:v2")).ref == v2.snapshot_id
    # The sandbox reports the template, not the tag.
    assert (await built.get("app:v2")).template_id == "app"
    # A build id is a tag too (E2B), while some tag still names that build.
    assert (await built.get(f"app:{v2.build_id}")).ref == v2.snapshot_id

    with pytest.raises(TagNotFound, match="tag 'v3' does not exist for template 'app'"):
        await built.get("app:v3")


async def test_a_tag_moves_with_the_record(tmp_path: Path) -> None:
    repo = FakeRepo()
    built = built_templates(tmp_path, FakeCatalog([]), repo)
    v1 = add_build(built, repo, "app", [DEFAULT_TAG])
    v2 = add_build(built, repo, "app", ["v2"])
    tpl = await built.state.template("app")
    assert tpl is not None
    tpl.tags[DEFAULT_TAG] = v2.build_id
    await built.state.update_template(tpl.template_id, lambda _: tpl)
    assert (await built.get("app")).ref == v2.snapshot_id
    # v1 lost its last tag: its build id no longer resolves.
    with pytest.raises(TagNotFound):
        await built.get(f"app:{v1.build_id}")
    del tpl.tags["v2"]
    await built.state.update_template(tpl.template_id, lambda _: tpl)
    with pytest.raises(TagNotFound):
        await built.get("app:v2")


async def test_only_ready_builds_with_a_snapshot_resolve(tmp_path: Path) -> None:
    repo = FakeRepo()
    built = built_templates(tmp_path, FakeCatalog([]), repo)
    add_build(built, repo, "app", [DEFAULT_TAG], status="building")
    with pytest.raises(TagNotFound, match="'default'"):
        await built.get("app")
    ready = add_build(built, repo, "gone", [DEFAULT_TAG])
    assert ready.snapshot_id is not None
    del repo.snaps[ready.snapshot_id]
    with pytest.raises(TemplateUnavailable, match="gone"):
        await built.get("gone")


async def test_other_names_go_to_the_catalog(tmp_path: Path) -> None:
    repo = FakeRepo()
    built = built_templates(tmp_path, FakeCatalog(["base"]), repo)
    got = await built.get("base")
    assert (got.name, got.ref, got.template_id) == ("base", "", "base")
    assert (await built.get("base:default")).template_id == "base"
    # Catalog templates and snapshots have no tags.
    with pytest.raises(TemplateUnavailable):
        await built.get("base:v1")
    with pytest.raises(TemplateUnavailable):
        await built.get("nothing")


async def test_the_builders_snapshots_are_internal(tmp_path: Path) -> None:
    repo = FakeRepo()
    built = built_templates(tmp_path, FakeCatalog([]), repo)
    rec = add_build(built, repo, "app", [DEFAULT_TAG])
    cache = repo.add(["build-cache-" + "0" * 40])
    mine = repo.add(["mine"])
    unnamed = repo.add([])
    assert await built.internal("build-cache-" + "0" * 40)
    assert await built.internal("build-final-whatever")
    assert rec.snapshot_id is not None
    assert await built.internal(rec.snapshot_id)
    assert await built.internal(cache.id)
    assert not await built.internal(mine.id)
    assert not await built.internal("mine")
    assert not await built.internal(unnamed.id)
    assert not await built.internal("app")
