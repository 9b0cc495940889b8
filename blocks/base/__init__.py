"""The step interfaces (``provider``, ``images``, ``compute``, ``storage``, ``serving``) and what every backend
shares: how it waits (``backoff``), what ends a job's wait (``watchdog``), the job's environment and secrets file,
how a command is launched, processes on this machine, the trained model's check, the run's logger.

Nothing here talks to an outside system; every folder beside this one builds on it.
"""
