"""Train on a Slurm cluster (``SlurmCluster``): one file per responsibility. ``cluster`` is the block;
``transport`` reaches the login node; ``script`` (and ``script_image``, ``values``) write the batch script;
``submit``, ``jobs``, ``arrays`` and ``containers`` are the block's parts for submitting, watching, sweeping and
running in the workload's image; ``state`` reads what Slurm's commands answer; ``store`` has the cluster store the
trained model; ``check`` is what ``gpuferry check`` asks it.
"""
