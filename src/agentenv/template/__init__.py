"""agentenv.template"""
