"""Container images from OCI registries: pull, cache, unpack, and block layers per chain.

- `reference` parses ``[registry/]repo[:tag][@digest]`` (Docker Hub defaults).
- `auth` answers ``WWW-Authenticate`` challenges (basic, bearer tokens cached per scope).
- `client.RegistryClient` speaks the distribution API (manifests, blobs, mirrors, resume).
- `manifest` / `config` are the typed manifest, index and image config.
- `cache.ImageCache` holds blobs and chain block layers under ``<home>/oci`` with an LRU cap
  and pins ("in use" by a template, snapshot, sandbox or running pull).
- `unpack.apply_layer` applies one layer archive onto a tree (whiteouts, owners, xattrs…).
- `blocks.ChainBuilder` turns the layer list into qcow2 block layers keyed by chain id.
- `pull.pull` ties them together. The design and its measured cost are in docs/oci.md.
"""
