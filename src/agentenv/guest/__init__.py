"""agentenv.guest"""
