#!/bin/sh
# Entry point of the agentenv image: prepares what a container lacks compared with a host
# process, then runs `aenv "$@"`. Its own variables (SLOT_RANGES_DIR) are not agentenv settings.
set -eu

# cgroup v2 in a private cgroup namespace: the container's cgroup is the namespace root, and a
# cgroup holding processes cannot enable controllers for children. vmm.cgroup enables memory,
# cpu and pids there for the sandboxes' cgroups, so every process moves to a leaf first.
if [ -f /sys/fs/cgroup/cgroup.controllers ] && [ "$(cat /proc/self/cgroup)" = "0::/" ]; then
  mkdir -p /sys/fs/cgroup/entry
  xargs -rn1 < /sys/fs/cgroup/cgroup.procs > /sys/fs/cgroup/entry/cgroup.procs 2>/dev/null || :
fi

# Kubernetes: each node's slot range comes from a ConfigMap mounted at SLOT_RANGES_DIR, one
# file per node name (deploy/kubernetes/slot-ranges.yaml). A node with no entry must not start
# with the default range: every node would then hand out the same addresses.
if [ -n "${SLOT_RANGES_DIR:-}" ] && [ -z "${AGENTENV_SLOT_CIDR:-}" ]; then
  if [ ! -r "$SLOT_RANGES_DIR/${AGENTENV_NODE_ID:-}" ]; then
    echo "no slot range for node '${AGENTENV_NODE_ID:-}' in $SLOT_RANGES_DIR" >&2
    exit 1
  fi
  AGENTENV_SLOT_CIDR="$(tr -d ' \n' < "$SLOT_RANGES_DIR/$AGENTENV_NODE_ID")"
  export AGENTENV_SLOT_CIDR
fi

# A node id is one DNS label; Kubernetes node names may be FQDNs.
if [ -n "${AGENTENV_NODE_ID:-}" ]; then
  AGENTENV_NODE_ID="$(printf %s "$AGENTENV_NODE_ID" | tr 'A-Z.' 'a-z-')"
  export AGENTENV_NODE_ID
fi

exec aenv "$@"
