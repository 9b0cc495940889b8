"""The user's workload: its ``gpuferry.yaml`` (``definition``, its hyperparameters' schema in ``hparams``),
where it comes from (a directory or a git URL: ``source``) and its code as one deterministic archive
(``archive``). Below every backend: they all take a workload, none of it knows a backend.
"""
