"""Checkpoints in S3-compatible object storage (``S3CheckpointStore``: AWS S3, Ceph RGW, MinIO): ``s3`` is the
block, ``s3_requests`` its request-level parts, ``check`` what ``gpuferry check`` asks.
"""
