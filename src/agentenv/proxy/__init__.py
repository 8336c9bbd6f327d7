"""agentenv.proxy"""
