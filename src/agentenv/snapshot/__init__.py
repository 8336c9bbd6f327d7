"""agentenv.snapshot"""
