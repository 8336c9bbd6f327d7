"""Template builds: E2B's step list run in a build sandbox, cached per step, captured as a
snapshot that sandboxes restore from (wire contract: docs/template-build.md)."""
