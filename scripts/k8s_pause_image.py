"""Write the node's pod-sandbox ("pause") image as a docker-archive tarball for `ctr images import`.

    python3 scripts/k8s_pause_image.py PAUSE_BINARY IMAGE_REF OUT.tar

One layer holding the static ``/pause`` binary (compiled by scripts/k8s.sh from the Kubernetes
source's build/pause/linux/pause.c), entrypoint ``/pause``. The node imports it into containerd
before the kubelet starts, so no sandbox image is ever pulled. Standard library only: it runs
before the project's virtual environment is needed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile


def layer_tar(binary: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        info.size, info.mode, info.mtime = len(binary), 0o755, 0
        tar.addfile(info, io.BytesIO(binary))
    return buf.getvalue()


def archive(binary: bytes, ref: str) -> bytes:
    layer = layer_tar(binary)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": "scripts/k8s_pause_image.py"}],
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref], "Layers": ["layer.tar"]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("layer.tar", layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: k8s_pause_image.py PAUSE_BINARY IMAGE_REF OUT.tar", file=sys.stderr)
        return 2
    binary_path, ref, out_path = argv
    with open(binary_path, "rb") as fh:
        data = archive(fh.read(), ref)
    with open(out_path + ".tmp", "wb") as fh:
        fh.write(data)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
