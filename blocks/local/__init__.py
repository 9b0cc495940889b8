"""The embedded default of every step, on this machine and with no server: this machine as the node, no image,
processes as jobs, a directory as the store, a process as the service.
"""
