"""agentenv.cluster"""
