"""The local machine as a node: GPUs read from nvidia-smi, checked against the job's needs."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from blocks.base.nvidia import parse_ctk_version, parse_cuda_version, parse_nvidia_smi
from blocks.base.provider import ClusterManaged, NodeRequirements
from blocks.errors import ConfigurationError
from blocks.local.provider import LocalMachine
from tasks.provision import inventory_rows

A100_QUERY = "0, NVIDIA A100-SXM4-80GB, 81920, 550.54.15\n1, NVIDIA A100-SXM4-80GB, 81920, 550.54.15\n"
A100_BANNER = "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |\n"


def fake_nvidia_smi(tmp_path: Path) -> str:
    """An nvidia-smi that prints what a two-A100 node prints."""
    path = tmp_path / "nvidia-smi"
    (tmp_path / "query.txt").write_text(A100_QUERY)
    (tmp_path / "banner.txt").write_text(A100_BANNER)
    path.write_text(f'#!/bin/sh\nif [ -n "$1" ]; then cat {tmp_path}/query.txt; else cat {tmp_path}/banner.txt; fi\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def fake_nvidia_ctk(tmp_path: Path, version_output: str) -> str:
    """An nvidia-ctk whose --version prints ``version_output``."""
    path = tmp_path / "nvidia-ctk"
    (tmp_path / "ctk.txt").write_text(version_output)
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec cat {tmp_path}/ctk.txt\nexit 2\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_parse() -> None:
    gpus = parse_nvidia_smi(A100_QUERY, parse_cuda_version(A100_BANNER))
    assert [(g.index, g.name, g.memory_mib, g.driver_version, g.cuda_version) for g in gpus] == [
        (0, "NVIDIA A100-SXM4-80GB", 81920, "550.54.15", "12.4"),
        (1, "NVIDIA A100-SXM4-80GB", 81920, "550.54.15", "12.4"),
    ]


def test_local_machine_with_gpus(tmp_path: Path) -> None:
    ctk = fake_nvidia_ctk(tmp_path, "NVIDIA Container Toolkit CLI version 1.16.2\ncommit: a470818\n")
    provider = LocalMachine(nvidia_smi=fake_nvidia_smi(tmp_path), nvidia_ctk=ctk)
    nodes = provider.check(provider.acquire(1, NodeRequirements(gpus=2), "run1"), NodeRequirements(gpus=2))
    assert len(nodes[0].gpus) == 2 and nodes[0].gpus[0].cuda_version == "12.4"
    assert nodes[0].labels == {"run": "run1", "toolkit": "1.16.2"}
    row = inventory_rows(nodes)[0]
    assert (row["driver"], row["cuda"], row["toolkit"]) == ("550.54.15", "12.4", "1.16.2")
    with pytest.raises(ConfigurationError, match=r"driver 550.54.15 is older than 560"):
        provider.check(nodes, NodeRequirements(gpus=1, min_driver_version="560.0"))


def test_cpu_only_machine_fails_gpu_preflight(tmp_path: Path) -> None:
    provider = LocalMachine(nvidia_smi=str(tmp_path / "absent"), nvidia_ctk=str(tmp_path / "absent-ctk"))
    nodes = provider.acquire(1, NodeRequirements(), "run1")
    checked = provider.check(nodes, NodeRequirements())
    assert checked[0].gpus == [] and checked[0].labels["toolkit"] == "missing"
    assert inventory_rows(checked)[0]["toolkit"] == "missing"
    with pytest.raises(ConfigurationError, match=r"0 GPU\(s\) found, 1 required"):
        provider.check(nodes, NodeRequirements(gpus=1))


def test_local_machine_is_one_node() -> None:
    with pytest.raises(ConfigurationError, match="resources.nodes=2"):
        LocalMachine().acquire(2, NodeRequirements(), "run1")


def test_cluster_managed_nodes_leave_gpus_to_the_scheduler() -> None:
    provider = ClusterManaged(cluster_name="gpuferry")
    nodes = provider.acquire(2, NodeRequirements(gpus=4), "run1")
    assert provider.bootstrap(nodes, NodeRequirements(gpus=4)) == nodes  # no local GPU check
    assert nodes[0].labels == {"run": "run1", "nodes": "2", "gpus_per_node": "4"}
    provider.release(nodes)


def test_toolkit_version_parsing(tmp_path: Path) -> None:
    assert parse_ctk_version("NVIDIA Container Toolkit CLI version 1.15.0\ncommit: ddeeca3") == "1.15.0"
    assert parse_ctk_version("nvidia-ctk version v1.14.6-rc.1") == "1.14.6-rc.1"
    assert parse_ctk_version("Usage: nvidia-ctk [global options]") is None
    # An nvidia-ctk that prints no version (broken install) counts as missing, not as a version.
    broken = LocalMachine(nvidia_smi=str(tmp_path / "absent"), nvidia_ctk=fake_nvidia_ctk(tmp_path, "oops\n"))
    assert broken.inspect(broken.acquire(1, NodeRequirements(), "r"))[0].labels["toolkit"] == "missing"


class _FailingBootstrap(LocalMachine):
    """A machine whose bootstrap fails, and whose release then fails too."""

    _block_type_slug = "test-failing-bootstrap"  # its own block type: LocalMachine's stays registered

    def bootstrap(self, nodes, requirements):  # type: ignore[no-untyped-def]
        raise ConfigurationError("preflight failed on node local: nvidia-smi missing")

    def release(self, nodes) -> None:  # type: ignore[no-untyped-def]
        raise OSError("controller unreachable")


def test_failed_release_after_failed_bootstrap_keeps_the_cause(prefect_server: None) -> None:
    from prefect import flow

    from tasks.provision import provision_nodes

    @flow
    def provision() -> None:
        provision_nodes(_FailingBootstrap(), 1, NodeRequirements(), "run1")

    with pytest.raises(ConfigurationError, match="nvidia-smi missing") as info:
        provision()
    assert any("controller unreachable" in note and "release them by hand" in note for note in info.value.__notes__)


def test_local_machine_inventory_carries_gpu_uuids(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path)
    (tmp_path / "query.txt").write_text(
        "0, NVIDIA H100 80GB HBM3, 81559, 550.54.15, GPU-1a2b3c4d-0000-1111-2222-333344445555\n"
    )
    nodes = LocalMachine(nvidia_smi=smi, nvidia_ctk=str(tmp_path / "absent")).host_inventory()
    assert len(nodes) == 1 and [(g.index, g.uuid) for g in nodes[0].gpus] == [
        (0, "GPU-1a2b3c4d-0000-1111-2222-333344445555")
    ]
    assert "GPU-1a2b3c4d" in inventory_rows(nodes)[0]["gpus"]
    assert ClusterManaged().host_inventory() == []  # a scheduler's nodes: nothing to read
