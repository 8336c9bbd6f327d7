"""agentenv.storage"""
