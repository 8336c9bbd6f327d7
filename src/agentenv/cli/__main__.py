"""`python -m agentenv.cli` runs `aenv`."""

from agentenv.cli.main import main

main()
