"""agentenv.orchestrator"""
