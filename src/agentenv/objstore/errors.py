"""Object storage errors: each names the bucket and key it is about."""

from __future__ import annotations


class ObjectStoreError(Exception):
    """A call to the object store failed, timed out, or returned something unusable."""

    def __init__(self, message: str, *, bucket: str, key: str | None = None) -> None:
        where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
        super().__init__(f"{where}: {message}")
        self.bucket = bucket
        self.key = key


class BlobNotFound(ObjectStoreError):
    """No object holds that digest."""


class BlobDigestMismatch(ObjectStoreError):
    """What was downloaded does not hash to the digest it was stored under."""
