"""Ports the guest listens on. A module of its own, outside the host's settings, because it is
packed into the tools layer with `agentenv.guest` (`template.tools.guest_sources`) and hashed
into that layer's key: a settings edit must not rebuild the tools image and with it every
template snapshot."""

# envd, in every guest (E2B's port: the SDKs address it by number).
ENVD_PORT = 49983
