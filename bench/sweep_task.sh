#!/bin/sh
# One configuration of the sweep benchmark (bench/slurm_sweep.py): trivial work, its settings echoed.
echo "$HPARAMS"
