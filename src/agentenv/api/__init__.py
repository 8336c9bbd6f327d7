"""agentenv.api"""
