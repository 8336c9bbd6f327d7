"""agentenv.cli"""
