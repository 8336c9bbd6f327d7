"""The control plane: the sandbox state machine (`sandboxes`), its store, team limits and
metrics. It reaches sandboxes only through `agentenv.contract.runtime.Runtime`."""
