#!/bin/sh
# One configuration of the sweep benchmark (bench/slurm_sweep.py), shipped to the cluster as the job's code: trivial work, its settings echoed.
echo "$HPARAMS"
