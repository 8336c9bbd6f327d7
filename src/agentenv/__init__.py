"""agentenv: microVM sandboxes for AI agents, wire-compatible with the E2B SDK."""

__version__ = "0.1.0"
