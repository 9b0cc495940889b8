"""Your own GPU hosts over SSH (``SshHosts``, a provider): what each has (``facts``), commands on it (``shell``),
joining it to a Slurm cluster as a dynamic node and taking it out again (``slurm_join``), and its checks.
"""
