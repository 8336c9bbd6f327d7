"""agentenv.vmm"""
