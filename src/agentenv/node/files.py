"""The node's names for a sandbox's files: `agentenv.files`, which every layer may import
(snapshot/ and vmm/ sit below node/). Kept so node modules import as before."""

from agentenv.files import META, ROOTFS, SandboxFiles, sandbox_files, snapshots_dir

__all__ = ["META", "ROOTFS", "SandboxFiles", "sandbox_files", "snapshots_dir"]
