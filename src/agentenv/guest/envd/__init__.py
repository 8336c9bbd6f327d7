"""agentenv.guest.envd"""
