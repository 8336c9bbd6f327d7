"""A node: runs sandboxes on one host (`host.Node`: VMs, slots, snapshots, warm pools, memory,
admission) and serves them to the control plane as a `Runtime` (`runtime.NodeRuntime`)."""
