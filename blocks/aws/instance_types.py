"""The GPU instance types ``Ec2Provider`` launches, and their GPUs as nvidia-smi names them (pure data).

EC2 does not report a GPU's driver or its exact name before the instance runs: a run's GPU request (count, memory
per GPU) is checked against this table before anything is launched.
"""

from __future__ import annotations

# (GPU model as nvidia-smi names it, memory per GPU in MiB as nvidia-smi reports it)
_T4 = ("Tesla T4", 15360)
_A10G = ("NVIDIA A10G", 23028)
_L4 = ("NVIDIA L4", 23034)
_L40S = ("NVIDIA L40S", 46068)
_V100 = ("Tesla V100-SXM2-16GB", 16384)
_V100_32 = ("Tesla V100-SXM2-32GB", 32768)
_A100_40 = ("NVIDIA A100-SXM4-40GB", 40960)
_A100_80 = ("NVIDIA A100-SXM4-80GB", 81920)
_H100 = ("NVIDIA H100 80GB HBM3", 81559)


def _family(gpu: tuple[str, int], counts: dict[str, int]) -> dict[str, tuple[int, str, int]]:
    return {size: (count, *gpu) for size, count in counts.items()}


# instance type -> (GPUs, model, MiB per GPU). The GPU instance types this provider launches.
GPU_INSTANCE_TYPES: dict[str, tuple[int, str, int]] = {
    **{
        f"g4dn.{s}": v
        for s, v in _family(
            _T4, {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1, "12xlarge": 4, "metal": 8}
        ).items()
    },
    **{
        f"g5.{s}": v
        for s, v in _family(
            _A10G,
            {
                "xlarge": 1,
                "2xlarge": 1,
                "4xlarge": 1,
                "8xlarge": 1,
                "16xlarge": 1,
                "12xlarge": 4,
                "24xlarge": 4,
                "48xlarge": 8,
            },
        ).items()
    },
    **{
        f"g6.{s}": v
        for s, v in _family(
            _L4,
            {
                "xlarge": 1,
                "2xlarge": 1,
                "4xlarge": 1,
                "8xlarge": 1,
                "16xlarge": 1,
                "12xlarge": 4,
                "24xlarge": 4,
                "48xlarge": 8,
            },
        ).items()
    },
    **{
        f"g6e.{s}": v
        for s, v in _family(
            _L40S,
            {
                "xlarge": 1,
                "2xlarge": 1,
                "4xlarge": 1,
                "8xlarge": 1,
                "16xlarge": 1,
                "12xlarge": 4,
                "24xlarge": 4,
                "48xlarge": 8,
            },
        ).items()
    },
    **{f"p3.{s}": v for s, v in _family(_V100, {"2xlarge": 1, "8xlarge": 4, "16xlarge": 8}).items()},
    "p3dn.24xlarge": (8, *_V100_32),
    "p4d.24xlarge": (8, *_A100_40),
    "p4de.24xlarge": (8, *_A100_80),
    "p5.48xlarge": (8, *_H100),
}
