"""Object storage: content-addressed blobs in an S3 bucket and a node's local cache of them.

`client.ObjectStore` (boto3 in its own bounded thread pool, deadlines on every call):
`put_file`/`put_source` → sha256 digest (deduplicated, multipart with per-part SHA-256,
resumable after a crash), `get_file`/`get_into` (verified while streaming), small named
objects (`put_json`/`get_json`) for manifests. `sparse` moves only a sparse file's data
extents. `cache.BlobCache`: local copies under a size limit, LRU eviction of unpinned
entries. Configured by `Settings.object_store` (`AGENTENV_S3_*`); None means a single node
with no object storage.
"""

from agentenv.objstore.bucket import TransferStats, blob_key
from agentenv.objstore.cache import BlobCache, CacheEntry
from agentenv.objstore.client import ObjectStore
from agentenv.objstore.errors import BlobDigestMismatch, BlobNotFound, ObjectStoreError
from agentenv.objstore.source import BlobSink, BlobSource, FileSink, FileSource
from agentenv.objstore.sparse import SparseSink, SparseSource

__all__ = [
    "BlobCache",
    "BlobDigestMismatch",
    "BlobNotFound",
    "BlobSink",
    "BlobSource",
    "CacheEntry",
    "FileSink",
    "FileSource",
    "ObjectStore",
    "ObjectStoreError",
    "SparseSink",
    "SparseSource",
    "TransferStats",
    "blob_key",
]
