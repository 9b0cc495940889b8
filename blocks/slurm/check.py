"""The checks of a Slurm cluster (``SlurmCluster.self_check``).

Over SSH: the port answers, the host key is the one in known_hosts, the user logs in. Then, as the jobs
would: the Slurm version, the partitions (state, nodes and GPUs from gres), the user's account and QoS
associations (the block's account and qos among them), the container runtime a job with an image would
use, the interpreter of image-less jobs and the jobs' directory. Every command is the block's own ``run``
on a copy whose timeouts are the probe's deadline. Nothing is submitted, nothing is written.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from blocks.checks import CheckFailed, Probe, Warn
from blocks.errors import ConfigurationError
from blocks.ssh.check import ssh_rows

if TYPE_CHECKING:
    from blocks.slurm.cluster import SlurmCluster


_GRES_GPU = re.compile(r"^gpu(?::[^:()]+)?:(\d+)")


def _partitions(text: str) -> dict[str, dict[str, Any]]:
    """``sinfo -h -o '%R|%a|%D|%G'`` lines → partition → {state, nodes, gpus}."""
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        name, state, nodes, gres = parts[0], parts[1], int(parts[2]) if parts[2].isdigit() else 0, parts[3]
        entry = out.setdefault(name, {"state": state, "nodes": 0, "gpus": 0})
        entry["nodes"] += nodes
        per_node = sum(int(m.group(1)) for item in gres.split(",") if (m := _GRES_GPU.match(item.strip())))
        entry["gpus"] += per_node * nodes
    return out


def check_slurm(cluster: SlurmCluster, probe: Probe) -> None:
    c = cluster.model_copy(update={"connect_timeout": probe.left, "command_timeout": probe.left})
    if cluster.local:
        probe.info("login node", "local=True: Slurm commands run on this machine")
    else:
        client = ssh_rows(probe, host=cluster.host, port=cluster.port, credentials=cluster.credentials)
        if client is None:
            return
        # The commands below go over this (verified) connection instead of opening another.
        c._session, c._session_for = c._new_session().adopt(client), c._connection_key
    try:
        _slurm_rows(c, probe)
    finally:
        c.close()


# What the checks ask the login node, in ONE command (each costs the login shell's start-up): every
# section's output and exit code, between markers. "$1" the user (empty: who logs in), "$2" the interpreter of
# image-less jobs, "$3" the jobs' directory. "runtimes": pyxis when `srun --help` lists --container-image, and
# the paths of podman and apptainer on the login node's PATH (what "auto" chooses among).
_FACTS_SH = (
    'u="${1:-$(id -un)}"; echo "@@user"; echo "$u"; echo "@@rc 0"; '
    'echo "@@version"; sinfo --version 2>&1; echo "@@rc $?"; '
    'echo "@@partitions"; sinfo -h -o "%R|%a|%D|%G" 2>&1; echo "@@rc $?"; '
    'echo "@@assoc"; sacctmgr -n -P show assoc where user="$u" format=Account,Partition,QOS 2>&1; echo "@@rc $?"; '
    'echo "@@runtimes"; srun --help 2>&1 | grep -q -- --container-image && echo pyxis; '
    'for r in podman apptainer; do command -v "$r"; done; echo "@@rc 0"; '
    'echo "@@python"; "$2" --version 2>&1; echo "@@rc $?"; '
    'echo "@@workdir"; d="$3"; while [ ! -d "$d" ]; do d=$(dirname "$d"); done; echo "$d"; test -w "$d"; echo "@@rc $?"'
)


def _sections(text: str) -> dict[str, tuple[int, str]]:
    """``@@name`` … ``@@rc N`` sections → name → (exit code, output)."""
    out: dict[str, tuple[int, str]] = {}
    name, lines = None, []
    for line in text.splitlines():
        if line.startswith("@@rc ") and name is not None:
            code = line[5:].strip()
            out[name] = (int(code) if code.isdigit() else 1, "\n".join(lines).strip())
            name, lines = None, []
        elif line.startswith("@@") and name is None:
            name = line[2:].strip()
        elif name is not None:
            lines.append(line)
    return out


def _accounts(text: str) -> dict[str, set[str]]:
    """``sacctmgr -n -P show assoc format=Account,Partition,QOS`` lines → account → the QoS allowed in it (an
    account with an association per partition: their union)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            out.setdefault(parts[0], set()).update(q for q in parts[2].split(",") if q)
    return out


def _runtimes(text: str) -> set[str]:
    """The "runtimes" section → the container runtimes the login node offers ({"pyxis", "podman", ...})."""
    return {line.strip().rsplit("/", 1)[-1] for line in text.splitlines() if line.strip()}


def _set_runtime(runtime: str, offered: set[str], needed: bool) -> Any:
    """The row of a container_runtime that is set (not "auto"): it must be one the login node offers."""
    note = "" if needed else "; not needed: the stack builds no image"
    if runtime in offered:
        return f"{runtime} (set){note}"
    missing = (
        "`srun --help` lists no --container-image (no pyxis)"
        if runtime == "pyxis"
        else f"no {runtime} on the login node's PATH"
    )
    found = ", ".join(sorted(offered)) or "none"
    if not needed:
        return Warn(
            f"container_runtime={runtime!r}, but {missing} (offered: {found}){note}",
            "set container_runtime to auto, or to one the cluster has",
        )
    other = f", or set container_runtime to {' or '.join([*sorted(offered), 'auto'])}" if offered else ""
    raise CheckFailed(
        f"container_runtime={runtime!r}, but {missing}; the cluster offers: {found}",
        f"install {runtime} on the nodes{other}",
    )


def _slurm_rows(c: SlurmCluster, probe: Probe) -> None:
    root = c.workdir_root or c.job_workdir("x").rsplit("/", 1)[0]
    facts: dict[str, tuple[int, str]] = {}

    def section(name: str, fix: str) -> str:
        rc, out = facts.get(name, (1, "no answer"))
        if rc != 0:
            raise CheckFailed(out[:400] or f"exit code {rc}", fix)
        return out

    def version() -> str:
        _, out, _ = c.run(["sh", "-c", _FACTS_SH, "sh", c.user or "", c.python, root], timeout=probe.left, check=False)
        facts.update(_sections(out))
        return section("version", "") or "unknown"

    if not probe.step(
        "Slurm version",
        version,
        "install the Slurm client commands on the login node, or fix slurm_conf; `sinfo --version` must work there",
    ):
        return
    found: dict[str, dict[str, Any]] = {}

    def partitions() -> Any:
        found.update(_partitions(section("partitions", "`sinfo` must work on the login node")))
        names = ", ".join(f"{n} ({p['state']}, {p['nodes']} nodes)" for n, p in found.items()) or "none"
        if c.partition is not None and c.partition not in found:
            raise CheckFailed(
                f"partition {c.partition!r} does not exist; the cluster has: {names}",
                f"set partition to one of: {', '.join(found) or '(none)'}",
            )
        if c.partition is not None and found[c.partition]["state"] != "up":
            return Warn(
                f"partition {c.partition!r} is {found[c.partition]['state']}; all: {names}",
                "jobs queue until an admin sets it up (`scontrol update partition=... state=up`)",
            )
        return names

    probe.step("partitions", partitions, "ask the admins for a partition you may use")

    def gpus() -> Any:
        counts = ", ".join(f"{n}: {p['gpus']}" for n, p in found.items())
        if not any(p["gpus"] for p in found.values()):
            return Warn(
                f"no partition has gres/gpu ({counts or 'no partitions'})",
                "jobs asking for GPUs cannot run here: ask for a GPU partition, or train on CPUs",
            )
        return f"GPUs (gres) per partition: {counts}"

    if found:
        probe.step("GPUs (gres)", gpus)
    user = facts.get("user", (0, c.user or "?"))[1]

    def associations() -> Any:
        rc, out = facts.get("assoc", (1, "no answer"))
        if rc != 0:
            return Warn(
                f"sacctmgr failed: {out[:200]} (no accounting database?)",
                "associations not checked: sbatch says so if the account or QoS is refused",
            )
        accounts = _accounts(out)
        if not accounts:
            return Warn(
                f"user {user!r} has no associations",
                "ask the admins to add you to an account "
                "(`sacctmgr add user NAME account=ACCOUNT`) if the cluster enforces them",
            )
        if c.account is not None and c.account not in accounts:
            raise CheckFailed(
                f"user {user!r} is not in account {c.account!r}; their accounts: {', '.join(accounts)}",
                f"set account to one of: {', '.join(accounts)}",
            )
        allowed = accounts.get(c.account, set()) if c.account else set().union(*accounts.values())
        if c.qos is not None and c.qos not in allowed:
            raise CheckFailed(
                f"QoS {c.qos!r} is not allowed for {user!r}; allowed: {', '.join(sorted(allowed))}",
                f"set qos to one of: {', '.join(sorted(allowed)) or '(none)'}",
            )
        return "; ".join(f"account {a}: QoS {', '.join(sorted(q)) or '-'}" for a, q in accounts.items())

    probe.step("account/QoS", associations)

    def runtime() -> Any:
        if c.container_runtime != "auto":
            return _set_runtime(c.container_runtime, _runtimes(facts.get("runtimes", (0, ""))[1]), probe.needs_image)
        try:
            found_runtime = c.job_container_runtime()  # what a job with an image would use, asked as submit asks
        except ConfigurationError as exc:
            if probe.needs_image:
                raise
            return f"none ({exc.__class__.__name__}); not needed: the stack builds no image"
        mode = "auto-detected" if c.container_runtime == "auto" else "set"
        return f"{found_runtime} ({mode}){'' if probe.needs_image else '; not needed: the stack builds no image'}"

    probe.step(
        "container runtime", runtime, "install pyxis, podman or apptainer on the nodes, or set container_runtime"
    )
    if not probe.needs_image:
        probe.step(
            "python",
            lambda: f"{c.python}: {section('python', '')}",
            "set python to an interpreter on the cluster's shared filesystem",
        )

    def workdir() -> str:
        rc, out = facts.get("workdir", (1, "?"))
        if rc != 0:
            raise CheckFailed(f"{root}: its nearest existing directory ({out or '?'}) is not writable by {user}")
        return f"{root} ({'exists' if out == root else 'created by the first job under ' + out})"

    probe.step(
        "jobs' directory", workdir, "set workdir_root to a directory on the shared filesystem the user may write"
    )
    if probe.store is not None and not c.local:
        _store_rows(c, probe)


# The trained model is stored by the login node itself (``python -m runtime.store``, blocks/slurm/store.py): its
# interpreter needs what that module imports, and the login node must reach the store's endpoint.
_STORE_IMPORTS = "import boto3, yaml; print('boto3', boto3.__version__, '/ PyYAML', yaml.__version__)"
_REACH = (
    "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()"
)


def _store_rows(c: SlurmCluster, probe: Probe) -> None:
    python = c.store_python or c.python

    def packages() -> str:
        rc, out, err = c.run([python, "-c", _STORE_IMPORTS], timeout=probe.left, check=False)
        if rc != 0:
            raise CheckFailed(
                f"{python} on the login node: {(err or out).strip().splitlines()[-1:] or ['exit ' + str(rc)]}",
                f"the login node stores the trained model with {python}: install boto3 and PyYAML for it "
                "(`pip install boto3 pyyaml`), or set store_python to an interpreter that has them",
            )
        return f"{python}: {out.strip()}"

    if not probe.step("store's Python", packages):
        return

    def endpoint() -> str:
        try:
            where = probe.store.remote_destination("check")
        except ConfigurationError as exc:
            raise CheckFailed(str(exc), "use a store the cluster can reach (an S3-compatible endpoint)") from None
        url = where.env.get("AWS_ENDPOINT_URL") or (
            f"https://s3.{where.env.get('AWS_DEFAULT_REGION', 'us-east-1')}.amazonaws.com"
        )
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        rc, out, err = c.run(
            [python, "-c", _REACH, host, str(port), str(max(1.0, probe.left - 1))], timeout=probe.left, check=False
        )
        if rc != 0:
            last = (err or out).strip().splitlines()[-1:] or [f"exit {rc}"]
            raise CheckFailed(
                f"the login node cannot reach {host}:{port}: {last[0]}",
                "open the network from the login node to the store's endpoint (the model is stored from there), "
                "or give the store an endpoint_url the cluster reaches",
            )
        return f"{url} answers from the login node"

    probe.step("store from the login node", endpoint)
