"""API keys (by id and by hash, written in one transaction) and idempotency keys in etcd: a
part of `etcd_store.EtcdStore`.

The key check (`key_by_hash`, every REST request) answers from a mirror of the hashes
(`cluster.mirror`, started with the store) while it is in step: a revocation made through
another replica or the CLI holds here once the watch delivers it (milliseconds), one made
here at once. A hash the mirror does not have (a key made a moment ago elsewhere, a wrong
key) is read from etcd, so a new key works at every replica at once."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time

from agentenv.cluster.etcd import (
    Etcd,
    KeyValue,
    Op,
    created_at,
    delete_op,
    get_op,
    modified_at,
    put_op,
    value_is,
)
from agentenv.cluster.mirror import PrefixMirror
from agentenv.control.etcd_kv import DuplicateKey, EtcdKv, _b64, _dumps, _part_ok
from agentenv.control.store import (
    DEFAULT_TEAM,
    ApiKey,
)


class EtcdKeys(EtcdKv):
    def __init__(self, etcd: Etcd) -> None:
        super().__init__(etcd)
        self.key_hashes = PrefixMirror(etcd, etcd.dir("api-key-hashes"), "api-key-hashes")

    # -- API keys ----------------------------------------------------------------------------

    def _key_key(self, key_id: str) -> bytes:
        return self.etcd.key("api-keys", key_id)

    def _hash_key(self, key_hash: str) -> bytes:
        return self.etcd.key("api-key-hashes", _b64(key_hash))

    @staticmethod
    def _api_key_of(kv: KeyValue) -> ApiKey:
        data = json.loads(kv.value)
        data.pop("hash", None)
        return ApiKey(**data)

    async def add_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey:
        if not _part_ok(key_id):
            raise ValueError(f"API key id {key_id!r}: not a valid key part")
        key = ApiKey(key_id, name, prefix, time.time(), None, team_id)
        value = _dumps({**dataclasses.asdict(key), "hash": key_hash})
        by_id, by_hash = self._key_key(key_id), self._hash_key(key_hash)
        result = await self.etcd.txn(
            [created_at(by_id, 0), created_at(by_hash, 0)],
            [put_op(by_id, value), put_op(by_hash, value)],
            [get_op(by_id)],
        )
        if not (result.succeeded or (result.ranges[0] and result.ranges[0][0].value == value)):
            raise DuplicateKey(f"API key {key_id} (or its hash) exists already")
        return key

    async def add_first_key(
        self, key_id: str, name: str, prefix: str, key_hash: str, team_id: str = DEFAULT_TEAM
    ) -> ApiKey | None:
        """Under a marker made in the same transaction: once any replica made the first key,
        no other ever does (even after every key was revoked)."""
        if not _part_ok(key_id):
            raise ValueError(f"API key id {key_id!r}: not a valid key part")
        key = ApiKey(key_id, name, prefix, time.time(), None, team_id)
        value = _dumps({**dataclasses.asdict(key), "hash": key_hash})
        by_id, by_hash = self._key_key(key_id), self._hash_key(key_hash)
        marker = self.etcd.key("first-api-key")
        result = await self.etcd.txn(
            [created_at(marker, 0), created_at(by_id, 0), created_at(by_hash, 0)],
            [put_op(marker, key_id.encode()), put_op(by_id, value), put_op(by_hash, value)],
            [],
        )
        return key if result.succeeded else None

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        at = self._hash_key(key_hash)
        known, kv = self.key_hashes.get(at)
        if not known or kv is None:
            kv = await self.etcd.get(at)
        return None if kv is None else self._api_key_of(kv)

    async def key(self, key_id: str) -> ApiKey | None:
        if not _part_ok(key_id):
            return None
        kv = await self.etcd.get(self._key_key(key_id))
        return None if kv is None else self._api_key_of(kv)

    async def keys(self) -> list[ApiKey]:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("api-keys"))
        return sorted((self._api_key_of(kv) for kv in kvs), key=lambda k: k.created_at)

    async def revoke_key(self, key_id: str) -> bool:
        if not _part_ok(key_id):
            return False

        def revoked(kv: KeyValue | None) -> bytes | None:
            if kv is None:
                return None
            data = json.loads(kv.value)
            if data.get("revoked_at") is not None:
                return None
            data["revoked_at"] = time.time()
            return _dumps(data)

        def by_hash(value: bytes) -> list[Op]:
            # The copy the key check reads, written in the same transaction; not answered
            # from the mirror until the watch brings the revocation (before it is sent: no
            # request here sees the key valid once the revocation has landed).
            at = self._hash_key(json.loads(value)["hash"])
            self.key_hashes.forget(at)
            return [put_op(at, value)]

        return await self._cas(self._key_key(key_id), revoked, f"API key {key_id}", also=by_hash)

    # -- idempotency -------------------------------------------------------------------------

    def _idem_key(self, api_key_id: str, key: str) -> bytes:
        return self.etcd.key("idempotency", _b64(api_key_id), _b64(key))

    async def claim_idempotency(self, api_key_id: str, key: str, body_hash: str) -> bool:
        at = self._idem_key(api_key_id, key)
        value = _dumps(
            {
                "body_hash": body_hash,
                "sandbox_id": None,
                "created_at": time.time(),
                "_w": secrets.token_hex(8),
            }
        )
        result = await self.etcd.txn([created_at(at, 0)], [put_op(at, value)], [get_op(at)])
        return result.succeeded or bool(result.ranges[0] and result.ranges[0][0].value == value)

    async def idempotency(self, api_key_id: str, key: str) -> tuple[str, str | None] | None:
        kv = await self.etcd.get(self._idem_key(api_key_id, key))
        if kv is None:
            return None
        data = json.loads(kv.value)
        return str(data["body_hash"]), data.get("sandbox_id")

    async def complete_idempotency(self, api_key_id: str, key: str, sandbox_id: str) -> None:

        def completed(kv: KeyValue | None) -> bytes | None:
            if kv is None:
                return None
            data = json.loads(kv.value)
            data["sandbox_id"] = sandbox_id
            return _dumps(data)

        await self._cas(self._idem_key(api_key_id, key), completed, f"idempotency key {key!r}")

    async def release_idempotency(self, api_key_id: str, key: str) -> None:
        at = self._idem_key(api_key_id, key)
        kv = await self.etcd.get(at)
        if kv is None or json.loads(kv.value).get("sandbox_id") is not None:
            return
        # Only the claim as read: a completed one (or a new claim) stays.
        await self.etcd.txn([value_is(at, kv.value)], [delete_op(at)])

    async def expire_idempotency(self, older_than: float) -> None:
        kvs, _ = await self.etcd.get_prefix(self.etcd.dir("idempotency"))
        for kv in kvs:
            if float(json.loads(kv.value)["created_at"]) < older_than:
                # Only as read: a key completed meanwhile is rewritten, and stays until next time.
                await self.etcd.txn([modified_at(kv.key, kv.mod_revision)], [delete_op(kv.key)])
