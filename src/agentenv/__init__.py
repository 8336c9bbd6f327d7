"""agentenv: microVM sandboxes for AI agents, wire-compatible with the E2B SDK."""

import importlib.util
import sys

__version__ = "0.1.0"

# httpcore runs `import sniffio` on every lock, event and shielded close it makes (several
# times per proxied request and per envd call). sniffio is not installed (anyio 4 dropped
# it), and Python does not remember a failed import: each one searched every sys.path entry
# again (~28 stats, ~70 us; ~7% of the server's CPU per `commands.run` through the proxy,
# #23). A None entry raises the same ImportError at once; set only when sniffio is absent.
if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
    sys.modules["sniffio"] = None  # type: ignore[assignment]
