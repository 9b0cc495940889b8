"""P3: a 2 GiB checkpoint (several shards) to S3-compatible storage and back.

One run, one server (the s3 stack: Ceph RGW 16.2, started with the idempotent `scripts/s3.sh up`; with
``--no-stack-up`` used as it runs), every side storing the same checkpoint into an empty prefix:

- ours: ``S3CheckpointStore.put`` with its defaults (hash every file, skip what is already stored,
  multipart + concurrent across files through one pool of requests, every body signed with its
  sha256 and no CRC32, HEAD-verify every object, manifest last), starting with an empty hash cache;
- boto3 tuned: one boto3 TransferManager with the same part size, threshold and concurrency as ours,
  every shard submitted at once (no hashing, no verification, no manifest);
- S3Bucket defaults: prefect-aws ``S3Bucket.upload_from_path`` for each shard, default TransferConfig.

Then ours again on the unchanged checkpoint: the bytes it moves (and, with the hash cache, no file
read again). Then the stored checkpoint comes back twice, in an order that turns each round: ours
(``S3CheckpointStore.get``: the manifest read, ranged GETs, every file hashed and checked before it
gets its name) and boto3 tuned (one TransferManager, the same range size and concurrency, every file
at once, nothing checked). The objects of one side are deleted before the next.

    .venv/bin/python bench/s3_upload.py [--shards 8] [--total-mib 2048] [--rounds 3] [--endpoint URL] [--no-stack-up]
            [--also-read-kib 1024] [--also-unsigned]

Each round runs the upload sides in an order that turns from round to round; the figures are the
medians of the rounds' throughputs. Every side starts after ``sync``: the file system's writeback of what
an earlier side wrote is not timed against the next. The machine's 1-minute load average is sampled before every side.

``--endpoint`` measures another S3-compatible server instead (credentials from ``AWS_ACCESS_KEY_ID``
and ``AWS_SECRET_ACCESS_KEY``).

Prints ``RESULT P3_vs_boto3 <ours/boto3 upload throughput>``, ``RESULT P3_vs_s3bucket <ours/S3Bucket
throughput>``, ``RESULT P3_download_vs_boto3 <ours/boto3 download throughput>``, ``RESULT
P3_reupload_bytes <bytes>`` and ``RESULT P3_load1_median <load>`` (with its minimum and maximum). Goals:
≥ 1.0, ≥ 1.5, ≥ 1.0 and 0. ``--also-read-kib N`` adds a third download side, ours reading each range's stream
N KiB at a time (the fetch reads 256 KiB), and ``RESULT P3_download_<N>KiB_reads_vs_boto3``.
``--also-unsigned`` adds a fourth upload side, the least work a client can make the server do: boto3 tuned
with no payload signature (``UNSIGNED-PAYLOAD``, so the server hashes no body for it) and no CRC32, hashing
nothing itself; ``RESULT P3_unsigned_vs_s3bucket`` is then the most any client could gain over S3Bucket's
defaults from this server on this machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # S3Bucket logs every upload at INFO

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from prefect_aws import AwsCredentials, S3Bucket
from prefect_aws.client_parameters import AwsClientParameters

from blocks.base.storage import HashCache
from blocks.storage.s3 import S3CheckpointStore
from runtime import checkpoint
from tests.stacks import stacks_root

MiB = 1 << 20


def s3_stack(start: bool = True) -> dict[str, str]:
    """The s3 stack's endpoint and keys; ``start``: bring it up first (idempotent; the script, not ``make``, so
    that the virtualenv is left as it is)."""
    if start:
        subprocess.run(["bash", "scripts/s3.sh", "up"], cwd=REPO, check=True)
    env = {}
    for line in (stacks_root() / "s3" / "env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def make_checkpoint(root: Path, shards: int, total_mib: int) -> int:
    root.mkdir(parents=True)
    per_shard = total_mib * MiB // shards
    block = os.urandom(16 * MiB)
    for i in range(shards):
        with open(root / f"model-{i:05d}-of-{shards:05d}.safetensors", "wb") as f:
            written = 0
            while written < per_shard:
                # Distinct content per 16 MiB block (no two shards or parts alike), cheap to make.
                chunk = (i * 1_000_003 + written).to_bytes(8, "little") + block[8 : min(16 * MiB, per_shard - written)]
                f.write(chunk)
                written += len(chunk)
    (root / "config.json").write_text(f'{{"shards": {shards}}}')
    return sum(p.stat().st_size for p in root.iterdir())


def empty_prefix(client: object, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def server_cpu_seconds() -> float | None:
    """CPU time so far of the s3 stack's daemons (radosgw, ceph-osd, ceph-mon), from their pid files."""
    total, found = 0.0, False
    for pidfile in (stacks_root() / "s3" / "ceph" / "run").glob("*.pid"):
        try:
            fields = Path(f"/proc/{pidfile.read_text().strip()}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        found = True
    return total if found else None


def timed(label: str, size: int, fn: Callable[[], object]) -> float:
    """Run ``fn``; print its time, throughput, this process's CPU time (of it in the kernel) and the server's (when
    it is the stack). Dirty pages are written out first: no side pays for the writeback of bytes another side (or
    the checkpoint's making) left in the page cache."""
    os.sync()
    server, client, kernel, start = server_cpu_seconds(), time.process_time(), os.times().system, time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    cpu = f"client CPU {time.process_time() - client:5.1f} s (kernel {os.times().system - kernel:4.1f} s)"
    if server is not None:
        cpu += f", server CPU {server_cpu_seconds() - server:5.1f} s"
    print(f"{label:<28} {seconds:7.2f} s  {size / MiB / seconds:8.1f} MiB/s  {cpu}", flush=True)
    return size / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three sides (medians reported)")
    parser.add_argument("--endpoint", help="another S3-compatible server (default: the s3 stack, started here)")
    parser.add_argument("--no-stack-up", action="store_true", help="use the s3 stack as it runs (its env file)")
    parser.add_argument(
        "--also-unsigned",
        action="store_true",
        help="also time boto3 tuned with unsigned payloads and no checksums (the server's ceiling)",
    )
    parser.add_argument(
        "--also-read-kib",
        type=int,
        metavar="KIB",
        help="also time ours reading each range's stream KIB at a time (the fetch's own: 256)",
    )
    args = parser.parse_args()

    if args.endpoint:
        env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        env["S3_ENDPOINT_URL"] = args.endpoint
        env["AWS_DEFAULT_REGION"] = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    else:
        env = s3_stack(start=not args.no_stack_up)
    credentials = AwsCredentials(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_client_parameters=AwsClientParameters(endpoint_url=env["S3_ENDPOINT_URL"]),
    )
    bucket_name = f"gpuferry-bench-{uuid.uuid4().hex[:8]}"
    bucket = S3Bucket(bucket_name=bucket_name, credentials=credentials)
    ours = S3CheckpointStore(bucket=bucket)
    plain = credentials.get_s3_client()
    plain.create_bucket(Bucket=bucket_name)

    work = Path(os.environ.get("GPUFERRY_CACHE", Path.home() / ".cache" / "gpuferry")) / "bench"
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="p3-", dir=work))
    os.environ["GPUFERRY_HOME"] = str(tmp / "home")  # an empty hash cache and upload journal
    try:
        src = tmp / "ckpt"
        size = make_checkpoint(src, args.shards, args.total_mib)
        files = sorted(p for p in src.iterdir())
        print(f"checkpoint: {len(files)} files, {size / MiB:.0f} MiB; server {env['S3_ENDPOINT_URL']}")

        def s3bucket_defaults() -> None:
            for path in files:
                bucket.upload_from_path(path, f"s3bucket/{path.name}")

        # boto3 tuned: a client of its own with the same connection pool as ours, botocore's defaults
        # otherwise; the same part size, threshold and concurrency as ours below.
        tuned_client = credentials.get_boto3_session().client(
            "s3",
            endpoint_url=env["S3_ENDPOINT_URL"],
            config=Config(max_pool_connections=ours.max_concurrency + ours.max_parallel_files + 2),
        )

        def boto3_upload(client: object, prefix: str) -> None:
            """Every shard at once through one TransferManager with ours' part size, threshold and concurrency."""
            config = TransferConfig(
                multipart_threshold=ours.multipart_threshold_mib * MiB,
                multipart_chunksize=ours.multipart_chunksize_mib * MiB,
                max_concurrency=ours.max_concurrency,
            )
            with create_transfer_manager(client, config) as manager:
                futures = [manager.upload(str(p), bucket_name, f"{prefix}{p.name}") for p in files]
                for future in futures:
                    future.result()

        def boto3_download(dest: Path) -> None:
            config = TransferConfig(
                multipart_threshold=ours.download_chunksize_mib * MiB,
                multipart_chunksize=ours.download_chunksize_mib * MiB,
                max_concurrency=ours.max_concurrency,
            )
            with create_transfer_manager(tuned_client, config) as manager:
                root = refs[-1].uri.split("/", 3)[3]
                futures = [manager.download(bucket_name, f"{root}/{p.name}", str(dest / p.name)) for p in files]
                for future in futures:
                    future.result()

        results: dict[str, list[float]] = {"s3bucket": [], "boto3": [], "ours": [], "get_ours": [], "get_boto3": []}
        loads: list[float] = []
        refs: list = []
        again = None

        def ours_put() -> None:
            refs.append(ours.put(src, "p3/run"))

        def download(key: str, label: str, fn: Callable[[Path], object]) -> None:
            dest = tmp / "down"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            loads.append(os.getloadavg()[0])
            results[key].append(timed(label, size, lambda: fn(dest)))
            shutil.rmtree(dest, ignore_errors=True)

        sides = [
            ("s3bucket", "S3Bucket.upload_from_path", s3bucket_defaults, "s3bucket/"),
            ("boto3", "boto3 TransferManager tuned", lambda: boto3_upload(tuned_client, "boto3/"), "boto3/"),
            ("ours", "ours (S3CheckpointStore)", ours_put, None),
        ]
        if args.also_unsigned:  # boto3 tuned's client, with no payload signature and no CRC32
            unsigned_client = credentials.get_boto3_session().client(
                "s3",
                endpoint_url=env["S3_ENDPOINT_URL"],
                config=tuned_client.meta.config.merge(
                    Config(request_checksum_calculation="when_required", s3={"payload_signing_enabled": False})
                ),
            )
            results["unsigned"] = []
            sides.insert(
                2,
                (
                    "unsigned",
                    "boto3 unsigned, no checksum",
                    lambda: boto3_upload(unsigned_client, "unsigned/"),
                    "unsigned/",
                ),
            )
        getters = [
            ("get_ours", "ours, verified get", lambda dest: ours.get(refs[-1].uri, dest)),
            ("get_boto3", "boto3 download tuned", boto3_download),
        ]
        if args.also_read_kib:

            def other_reads(dest: Path) -> None:
                saved, checkpoint._READ = checkpoint._READ, args.also_read_kib << 10
                try:
                    ours.get(refs[-1].uri, dest)
                finally:
                    checkpoint._READ = saved

            results["get_other"] = []
            getters.append(("get_other", f"ours, {args.also_read_kib} KiB reads", other_reads))
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}", flush=True)
            # The order turns each round: no side always runs first (or on a server that just worked).
            for key, label, fn, prefix in sides[round_ % len(sides) :] + sides[: round_ % len(sides)]:
                loads.append(os.getloadavg()[0])
                results[key].append(timed(label, size, fn))
                if prefix:
                    empty_prefix(plain, bucket_name, prefix)
                    continue
                start = time.perf_counter()
                again = ours.put(src, "p3/run")
                print(
                    f"{'ours, unchanged re-upload':<28} {time.perf_counter() - start:7.2f} s  "
                    f"{again.bytes_uploaded} bytes moved",
                    flush=True,
                )
                assert refs[-1].bytes_uploaded == size and again.sha256 == refs[-1].sha256
                turn = round_ % len(getters)
                for get_key, get_label, get in getters[turn:] + getters[:turn]:
                    download(get_key, get_label, get)
                ours.delete(refs[-1].uri)
                shutil.rmtree(HashCache().root, ignore_errors=True)  # the next round starts with an empty hash cache
        median = {key: statistics.median(values) for key, values in results.items()}
        print("median MiB/s: " + ", ".join(f"{k} {v / MiB:.1f}" for k, v in median.items()))
        print(f"\nRESULT P3_vs_boto3 {median['ours'] / median['boto3']:.2f}")
        print(f"RESULT P3_vs_s3bucket {median['ours'] / median['s3bucket']:.2f}")
        print(f"RESULT P3_download_vs_boto3 {median['get_ours'] / median['get_boto3']:.2f}")
        if args.also_unsigned:
            print(f"RESULT P3_unsigned_vs_s3bucket {median['unsigned'] / median['s3bucket']:.2f}")
        if args.also_read_kib:
            print(
                f"RESULT P3_download_{args.also_read_kib}KiB_reads_vs_boto3 "
                f"{median['get_other'] / median['get_boto3']:.2f}"
            )
        print(f"RESULT P3_reupload_bytes {again.bytes_uploaded}")
        print(
            f"RESULT P3_load1_median {statistics.median(loads):.1f} (min {min(loads):.1f}, max {max(loads):.1f}, "
            f"{os.cpu_count()} CPUs)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        empty_prefix(plain, bucket_name, "")
        plain.delete_bucket(Bucket=bucket_name)


if __name__ == "__main__":
    main()
