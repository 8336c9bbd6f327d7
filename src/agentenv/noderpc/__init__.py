"""The control plane <-> node contract (`agentenv.contract.runtime.Runtime`) over Connect RPC.

`server.node_app(runtime, token)` serves any `Runtime` as `agentenv.node.v1.NodeService`
(`proto/node.proto`, stubs in `gen/` from `scripts/gen-proto`); `client.RemoteRuntime(url,
token)` is a `Runtime` that calls one. Values travel as protobuf messages (`convert`), the
contract's failures as typed error details (`errors`). This package knows neither the node's
code nor the control plane's: it imports only the contract, the egress policy and settings.
"""
