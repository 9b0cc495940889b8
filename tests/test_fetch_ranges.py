"""The verified S3 fetch's ranges (runtime/checkpoint.py), without a server: ranges landing in any order are hashed
once each, in file order; each file's earlier ranges are asked first; a stream that breaks is asked again from where
it broke; a damaged byte is refused; a range that fails stops the fetch, leaving no file behind."""

from __future__ import annotations

import hashlib
import os
import random
import re
import threading
from pathlib import Path

import pytest
from botocore.exceptions import ResponseStreamingError

from runtime import contract
from runtime.checkpoint import UnverifiedCheckpoint, _InOrderDigest, _RangePool, fetch_s3


def test_ranges_written_in_any_order_are_hashed_in_file_order(tmp_path: Path) -> None:
    rng = random.Random(22)
    for trial in range(300):
        data = rng.randbytes(rng.randint(0, 6000))
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 7)))) if len(data) > 1 else []
        pieces = []  # per range: its pieces in the order its stream delivers them
        for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
            bounds = list(range(start, end, rng.randint(1, 900))) + [end]
            pieces.append([(a, data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)])
        with open(tmp_path / f"f{trial}", "wb+") as f:
            digest = _InOrderDigest(f.fileno())
            while any(pieces):
                stream = rng.choice([p for p in pieces if p])
                digest.write(*stream.pop(0))
                if rng.random() < 0.3:
                    digest.catch_up()
            digest.catch_up()
            assert digest.hashed == len(data)
            assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
            f.seek(0)
            assert f.read() == data


def test_ranges_written_by_concurrent_threads_are_hashed_once(tmp_path: Path) -> None:
    data = os.urandom(4 << 20)
    ranges = [(a, min(len(data), a + 300_000)) for a in range(0, len(data), 300_000)]
    with open(tmp_path / "f", "wb+") as f:
        digest = _InOrderDigest(f.fileno())

        def stream(start: int, end: int) -> None:
            for a in range(start, end, 4096):
                digest.write(a, data[a : min(end, a + 4096)])

        threads = [threading.Thread(target=stream, args=span) for span in reversed(ranges)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
            digest.catch_up()
        assert digest.hashed == len(data) and digest.hexdigest() == hashlib.sha256(data).hexdigest()


class _Body:
    def __init__(self, data: bytes, break_after: int | None) -> None:
        self.data, self.break_after = data, break_after

    def read(self) -> bytes:
        return self.data

    def iter_chunks(self, size: int):
        for at in range(0, len(self.data), 1000):
            if self.break_after is not None and at >= self.break_after:
                raise ResponseStreamingError(error="connection reset")
            yield self.data[at : at + 1000]


class _Store:
    """get_object over one object and its manifest; the first answer for each range breaks its stream once."""

    def __init__(self, data: bytes, stored: bytes | None = None) -> None:
        self.data, self.stored = data, data if stored is None else stored
        self.ranges: list[str] = []
        self.broken: set[int] = set()  # the ends of the ranges whose stream broke once
        self.lock = threading.Lock()
        entry = {"path": "model.bin", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.manifest = contract.manifest_bytes({"format": contract.MANIFEST_FORMAT, "files": [entry]})

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict:  # noqa: N803 - boto3's names
        if Key.endswith(contract.MANIFEST_FILENAME):
            return {"Body": _Body(self.manifest, None)}
        start, end = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", Range).groups())
        with self.lock:
            self.ranges.append(Range)
            first = end not in self.broken  # each range's first answer (a range is named by its end)
            self.broken.add(end)
        body = self.stored[start : end + 1]
        return {"Body": _Body(body, 2000 if first else None), "ContentRange": f"bytes {start}-{end}/{len(self.stored)}"}


def test_a_broken_range_is_asked_again_from_where_it_broke(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    store = _Store(data)
    fetch_s3(store, "bucket", "ckpt", tmp_path, chunk_size=10_000, max_concurrency=3)
    assert (tmp_path / "model.bin").read_bytes() == data
    for start in range(0, len(data), 10_000):
        # each range twice: from its start, then from the 2000 bytes its broken stream had delivered
        assert f"bytes={start}-{start + 9_999}" in store.ranges
        assert f"bytes={start + 2000}-{start + 9_999}" in store.ranges
    assert len(store.ranges) == 10


def test_a_damaged_byte_is_refused_and_nothing_gets_the_name(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    damaged = bytearray(data)
    damaged[31_234] ^= 1
    with pytest.raises(UnverifiedCheckpoint, match="model.bin: sha256"):
        fetch_s3(_Store(data, bytes(damaged)), "bucket", "ckpt", tmp_path, chunk_size=10_000, max_concurrency=3)
    assert not (tmp_path / "model.bin").exists()
    assert not list(tmp_path.glob(".*partial"))


class _Files:
    """get_object over several objects and their manifest; ``short`` names an object whose answers report a size
    other than the manifest's."""

    def __init__(self, objects: dict[str, bytes], short: str | None = None) -> None:
        self.objects, self.short = objects, short
        entries = [{"path": p, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for p, d in objects.items()]
        self.manifest = contract.manifest_bytes({"format": contract.MANIFEST_FORMAT, "files": entries})

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict:  # noqa: N803 - boto3's names
        if Key.endswith(contract.MANIFEST_FILENAME):
            return {"Body": _Body(self.manifest, None)}
        path = Key.removeprefix("ckpt/")
        start, end = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", Range).groups())
        data = self.objects[path]
        total = len(data) + (1 if path == self.short else 0)
        return {"Body": _Body(data[start : end + 1], None), "ContentRange": f"bytes {start}-{end}/{total}"}


def test_files_fetched_together_are_each_whole(tmp_path: Path) -> None:
    objects = {f"shard-{i}.bin": os.urandom(25_000) for i in range(3)}
    fetch_s3(_Files(objects), "bucket", "ckpt", tmp_path, chunk_size=10_000, max_concurrency=2)
    for path, data in objects.items():
        assert (tmp_path / path).read_bytes() == data


def test_a_range_that_fails_stops_the_fetch_and_leaves_no_file(tmp_path: Path) -> None:
    objects = {f"shard-{i}.bin": os.urandom(200_000) for i in range(4)}
    with pytest.raises(UnverifiedCheckpoint, match=r"shard-2.bin: sha256 \(not read\)"):
        fetch_s3(_Files(objects, short="shard-2.bin"), "bucket", "ckpt", tmp_path, chunk_size=1000, max_concurrency=4)
    assert not (tmp_path / "shard-2.bin").exists()
    assert not list(tmp_path.glob(".*partial"))


def test_the_range_pool_runs_each_files_earlier_ranges_first() -> None:
    """With its one thread busy, ranges queued as three files' threads submit them (each file all its ranges at
    once) run by their place in their file, then in the order they came: every file's first range before any
    second one."""
    ran: list[str] = []
    release = threading.Event()
    with _RangePool(1) as pool:
        busy = pool.submit(0, release.wait)
        futures = [pool.submit(rank, ran.append, f"{name}{rank}") for name in "abc" for rank in range(3)]
        release.set()
        for future in [busy, *futures]:
            future.result(timeout=30)
    assert ran == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]


def test_the_range_pool_runs_as_many_at_once_as_it_has_threads() -> None:
    barrier = threading.Barrier(4, timeout=30)  # passes only when all four run at the same time
    with _RangePool(4) as pool:
        futures = [pool.submit(0, barrier.wait) for _ in range(4)]
        assert sorted(f.result(timeout=60) for f in futures) == [0, 1, 2, 3]


def test_a_cancelled_range_does_not_run() -> None:
    ran: list[int] = []
    release = threading.Event()
    with _RangePool(1) as pool:
        busy = pool.submit(0, release.wait)
        queued = pool.submit(1, ran.append, 1)
        assert queued.cancel()
        release.set()
        busy.result(timeout=30)
    assert ran == [] and queued.cancelled()
