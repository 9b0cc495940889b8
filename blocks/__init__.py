"""Prefect blocks: the typed configuration of each outside system gpuferry talks to, and its client methods.

One folder per outside system, over ``base/`` (the step interfaces and what backends share):

==============  ==========================================================================================
``base/``       the interfaces of the steps (provider, images, compute, storage, serving) and shared parts
``workload/``   the user's workload: ``gpuferry.yaml``, its hyperparameters, its source and code archive
``local/``      the embedded default of every step, on this machine
``ssh/``        SSH credentials and sessions, for every block that reaches a machine
``hosts/``      your own GPU hosts over SSH, and their joining a Slurm cluster
``aws/``        GPU nodes from EC2
``slurm/``      training on a Slurm cluster
``docker/``     training and serving on one Docker host, and building images
``kubernetes/`` serving on Kubernetes
``storage/``    checkpoints in S3-compatible storage
``tracking/``   MLflow tracking and registry
==============  ==========================================================================================

At this level: the bottom layer every folder uses (``errors``, ``specs`` and ``records``, ``values``,
``checks``, ``config_file``, ``home``) and the composition root that uses every folder (``stack``, ``stack_file``,
``plan``). Imports go one way (``pyproject.toml``'s import contracts, checked by ``make test``); how to add a
backend is in ``docs/contributing.md``.
"""
