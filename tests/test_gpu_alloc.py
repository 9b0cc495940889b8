"""GPU bookkeeping of a host without a scheduler (blocks/docker/gpu_alloc.py): pure, no engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from blocks.base.nvidia import parse_nvidia_smi
from blocks.docker.gpu_alloc import (
    Claim,
    GpuRequest,
    GpusBusy,
    HostGpu,
    choose,
    inventory_of,
    parse_claim_label,
    resolve,
)
from blocks.errors import ConfigurationError
from blocks.specs import Resources, ServingSpec
from tasks.retry import is_transient

QUERY = "".join(
    f"{i}, NVIDIA A100-SXM4-80GB, 81920, 550.54.15, GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}\n" for i in range(4)
)
HOST = inventory_of(parse_nvidia_smi(QUERY))
UUID = [g.uuid for g in HOST]


def keys(gpus: list[HostGpu]) -> list[int]:
    return [g.index for g in gpus]


def test_the_inventory_comes_from_nvidia_smi_with_uuids() -> None:
    assert keys(HOST) == [0, 1, 2, 3]
    assert HOST[2].uuid == "GPU-00000002-aaaa-bbbb-cccc-000000000002" and HOST[2].key == HOST[2].uuid
    assert HOST[0].name == "NVIDIA A100-SXM4-80GB"
    # An older nvidia-smi query without the UUID column still parses; the index is the GPU's key then.
    old = inventory_of(parse_nvidia_smi("0, Tesla T4, 15360, 535.1\n"))
    assert old[0].uuid is None and old[0].key == "0"
    with pytest.raises(ConfigurationError, match="lists the index 0 twice"):
        inventory_of(parse_nvidia_smi("0, T4, 1, 1, GPU-a\n0, T4, 1, 1, GPU-b\n"))


def test_a_count_takes_the_lowest_free_indices() -> None:
    assert keys(choose(HOST, GpuRequest(count=2), [])) == [0, 1]
    held = [Claim("job a", (UUID[0], UUID[1]))]
    assert keys(choose(HOST, GpuRequest(count=2), held)) == [2, 3]
    assert choose(HOST, GpuRequest(count=0), held) == []


def test_two_requests_never_get_the_same_gpu() -> None:
    first = choose(HOST, GpuRequest(count=2), [])
    second = choose(HOST, GpuRequest(count=2), [Claim("job a", tuple(g.key for g in first))])
    assert not {g.key for g in first} & {g.key for g in second}


def test_gpus_by_index_and_by_uuid() -> None:
    assert keys(choose(HOST, GpuRequest(devices=("0", "2")), [])) == [0, 2]
    assert keys(choose(HOST, GpuRequest(devices=(UUID[3], UUID[1].lower())), [])) == [3, 1]
    assert GpuRequest(devices=(UUID[3],)).by_uuid and not GpuRequest(devices=("3",)).by_uuid


def test_more_gpus_than_the_host_has_fails_naming_what_it_has() -> None:
    with pytest.raises(ConfigurationError, match=r"asks for 5 GPU\(s\) but gpu1 has 4: 0 \(GPU-00000000-") as caught:
        choose(HOST, GpuRequest(count=5), [], host="gpu1")
    assert UUID[3] in str(caught.value) and not isinstance(caught.value, GpusBusy)


def test_an_index_or_uuid_the_host_lacks_fails_naming_what_it_has() -> None:
    with pytest.raises(ConfigurationError, match=r"names '7', which gpu1 does not have; it has 4 GPU\(s\): 0 \(GPU-"):
        choose(HOST, GpuRequest(devices=("1", "7")), [], host="gpu1")
    with pytest.raises(ConfigurationError, match=r"names 'GPU-feedface'.*3 \(GPU-00000003"):
        resolve(HOST, ["GPU-feedface"])
    with pytest.raises(ConfigurationError, match="names one GPU of the host twice"):
        resolve(HOST, ["1", UUID[1]])


def test_a_third_request_that_does_not_fit_names_the_holders() -> None:
    claims = [Claim("container job-a", (UUID[0], UUID[1])), Claim("container job-b", (UUID[2], UUID[3]))]
    with pytest.raises(
        GpusBusy,
        match=r"cannot give 1 GPU\(s\) now: GPU 0 .* by container job-a.*GPU 3 .* by "
        r"container job-b\. Free: none of 4",
    ) as caught:
        choose(HOST, GpuRequest(count=1), claims, host="gpu1")
    assert not is_transient(caught.value)
    with pytest.raises(GpusBusy, match=r"gpu_devices \['2'\].*GPU 2 .* by container job-b"):
        choose(HOST, GpuRequest(devices=("2",)), claims)


def test_sharing_needs_both_sides() -> None:
    exclusive = [Claim("job a", (UUID[0],), shared=False)]
    sharing = [Claim("job a", (UUID[0],), shared=True)]
    with pytest.raises(GpusBusy, match="share_gpus on both"):
        choose(HOST, GpuRequest(devices=("0",), share=True), exclusive)
    assert keys(choose(HOST, GpuRequest(devices=("0",), share=True), sharing)) == [0]
    with pytest.raises(GpusBusy):
        choose(HOST, GpuRequest(devices=("0",), share=False), sharing)
    # A sharing count prefers GPUs nobody uses, then the least shared ones.
    crowded = [Claim("a", (UUID[0], UUID[1], UUID[2]), shared=True), Claim("b", (UUID[0],), shared=True)]
    assert keys(choose(HOST, GpuRequest(count=1, share=True), crowded)) == [3]
    full = crowded + [Claim("c", (UUID[3],), shared=True), Claim("d", (UUID[3],), shared=True)]
    assert keys(choose(HOST, GpuRequest(count=2, share=True), full)) == [1, 2]


def test_a_service_takes_over_its_predecessors_gpus_only_when_others_are_taken() -> None:
    predecessor = [Claim("digits v1", (UUID[0],))]
    assert keys(choose(HOST, GpuRequest(count=1), [], yielding=predecessor)) == [1]
    others = [Claim("job", (UUID[1], UUID[2], UUID[3]))]
    assert keys(choose(HOST, GpuRequest(count=1), others, yielding=predecessor)) == [0]


def test_claim_labels_round_trip() -> None:
    assert parse_claim_label(f"{UUID[0]},{UUID[2]}") == (UUID[0], UUID[2])
    assert parse_claim_label(None) == () and parse_claim_label("") == ()


def test_specs_take_gpus_by_devices() -> None:
    res = Resources(gpu_devices=["0", "2"])
    assert res.gpus_per_node == 2  # the count follows the devices named
    assert ServingSpec(gpu_devices=[UUID[1]]).gpus == 1
    with pytest.raises(ValidationError, match="gpus_per_node=3 but gpu_devices names 2"):
        Resources(gpus_per_node=3, gpu_devices=["0", "1"])
    with pytest.raises(ValidationError, match="names 1 more than once"):
        Resources(gpu_devices=["1", "1"])
    with pytest.raises(ValidationError, match="is not a GPU index or UUID"):
        Resources(gpu_devices=["0; rm -rf /"])
    with pytest.raises(ValidationError, match="either gpus or mig_profile"):
        ServingSpec(gpu_devices=["0"], mig_profile="1g.10gb")
