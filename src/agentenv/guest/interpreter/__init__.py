"""The code-interpreter server that runs inside a sandbox (guest port 49999).

It speaks the protocol of e2b-dev/code-interpreter's server, so the `e2b-code-interpreter` SDKs
(`Sandbox.run_code`, contexts) work unchanged; see docs/code-interpreter.md. The template copies
this directory into the guest image as a standalone package and runs it with the image's
python3 (`python3 -m <dir> --port 49999`), so it imports nothing from agentenv and uses only
relative imports and the wheels of requirements.txt.
"""
