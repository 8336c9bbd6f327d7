"""agentenv.cluster: the state nodes and control-plane replicas share, in etcd.

- `etcd.Etcd`: one client over every etcd member, failing over between them, a deadline on
  every call (`ClusterUnavailable` after it).
- `membership`: node records under leases with heartbeats (alive = the key exists), cordons
  (persistent), the join/leave watch.
- `bindings`: sandbox -> node, changed only by guarded transactions, persistent.
- `locations`: which live nodes hold a copy of a template or snapshot (on the holder's lease).

Nothing here elects a leader or keeps state of its own: etcd's leases, revisions and
transactions are the only coordination. Single-node agentenv (no `AGENTENV_ETCD`) uses none
of it.
"""
