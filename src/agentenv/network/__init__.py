"""agentenv.network"""
