"""The checks of a Slurm cluster (``SlurmCluster.self_check``) and of SSH hosts (``SshHosts.self_check``).

Over SSH: the port answers, the host key is the one in known_hosts, the user logs in. Then, as the jobs
would: the Slurm version, the partitions (state, nodes and GPUs from gres), the user's account and QoS
associations (the block's account and qos among them), the container runtime a job with an image would
use, the interpreter of image-less jobs and the jobs' directory. Every command is the block's own ``run``
on a copy whose timeouts are the probe's deadline. Nothing is submitted, nothing is written.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from blocks.checks import CheckFailed, Probe, Warn, tcp_reach
from blocks.errors import ConfigurationError

if TYPE_CHECKING:
    import paramiko

    from blocks.slurm import SlurmCluster
    from blocks.ssh_hosts import SshHosts

_GRES_GPU = re.compile(r"^gpu(?::[^:()]+)?:(\d+)")


def ssh_rows(probe: Probe, *, host: str | None, port: int, user: str | None, key_text: str | None,
             passphrase: str | None, known_hosts: str, label: str = "") -> paramiko.SSHClient | None:  # fmt: skip
    """The rows SSH reach, host key and login of one host; the logged-in client, or None when one failed."""
    from blocks._ssh import connect_verified, fingerprint, load_private_key, parse_known_hosts

    prefix = f"{label} " if label else ""
    if not host or not user or not key_text:
        missing = [n for n, v in (("host", host), ("user", user), ("private_key", key_text)) if not v]
        probe.add(f"{prefix}SSH", "failed", f"{', '.join(missing)} not set", "set them in the stack file")
        return None
    if not probe.step(f"{prefix}SSH reach", lambda: tcp_reach(host, port, probe.left),
                      "check host and port, and that this machine may reach the login node (VPN, firewall)"):
        return None
    login_fix = f"check user and private_key, and that the public key is in ~{user}/.ssh/authorized_keys"
    try:
        key = load_private_key(key_text, passphrase)
    except ConfigurationError as exc:
        probe.add(f"{prefix}SSH login", "failed", str(exc), login_fix)
        return None
    client: list[Any] = []
    refused: list[str] = []

    def host_key() -> str:
        try:
            client.append(connect_verified(
                address=host, port=port, user=user, key=key, known=parse_known_hosts(known_hosts),
                timeout=probe.left, name=f"{host}:{port}", check_against="matches the one the admins publish",
            ))  # fmt: skip
        except ConfigurationError as exc:
            if "SSH login as" not in str(exc):
                raise
            refused.append(str(exc))  # paramiko checks the host key before it authenticates: the key was fine
            return "matches known_hosts"
        remote = client[0].get_transport().get_remote_server_key()
        return f"{remote.get_name()} {fingerprint(remote)} matches known_hosts"

    keyscan = f"ssh-keyscan -p {port} {host}"
    if not probe.step(f"{prefix}SSH host key", host_key, f"compare `{keyscan}` with the fingerprint the admins "
                      "publish, then put its line in known_hosts"):
        return None
    if refused:
        probe.add(f"{prefix}SSH login", "failed", refused[0], login_fix)
        return None
    probe.add(f"{prefix}SSH login", "ok", f"logged in as {user}")
    return client[0]


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
    if cluster.local:
        probe.info("login node", "local=True: Slurm commands run on this machine")
    else:
        client = ssh_rows(
            probe, host=cluster.host, port=cluster.port, user=cluster.user,
            key_text=cluster.private_key.get_secret_value() if cluster.private_key else None,
            passphrase=cluster.private_key_passphrase.get_secret_value() if cluster.private_key_passphrase else None,
            known_hosts=cluster.known_hosts,
        )  # fmt: skip
        if client is None:
            return
        client.close()
    c = cluster.model_copy(update={"connect_timeout": probe.left, "command_timeout": probe.left})
    try:
        _slurm_rows(c, probe)
    finally:
        c.close()


def _slurm_rows(c: SlurmCluster, probe: Probe) -> None:
    def version() -> str:
        _, out, _ = c.run(["sinfo", "--version"], timeout=probe.left)
        return out.strip() or "unknown"

    if not probe.step("Slurm version", version, "install the Slurm client commands on the login node, or fix "
                      "slurm_conf; `sinfo --version` must work there"):
        return
    found: dict[str, dict[str, Any]] = {}

    def partitions() -> str:
        _, out, _ = c.run(["sinfo", "-h", "-o", "%R|%a|%D|%G"], timeout=probe.left)
        found.update(_partitions(out))
        names = ", ".join(f"{n} ({p['state']}, {p['nodes']} nodes)" for n, p in found.items()) or "none"
        if c.partition is not None and c.partition not in found:
            raise CheckFailed(f"partition {c.partition!r} does not exist; the cluster has: {names}",
                              f"set partition to one of: {', '.join(found) or '(none)'}")  # fmt: skip
        if c.partition is not None and found[c.partition]["state"] != "up":
            return Warn(f"partition {c.partition!r} is {found[c.partition]['state']}; all: {names}",
                        "jobs queue until an admin sets it up (`scontrol update partition=... state=up`)")
        return names

    probe.step("partitions", partitions, "ask the admins for a partition you may use")

    def gpus() -> Any:
        counts = ", ".join(f"{n}: {p['gpus']}" for n, p in found.items())
        if not any(p["gpus"] for p in found.values()):
            return Warn(f"no partition has gres/gpu ({counts or 'no partitions'})",
                        "jobs asking for GPUs cannot run here: ask for a GPU partition, or train on CPUs")
        return f"GPUs (gres) per partition: {counts}"

    if found:
        probe.step("GPUs (gres)", gpus)
    user: list[str] = [c.user or ""]

    def associations() -> Any:
        if not user[0]:
            user[0] = c.run(["id", "-un"], timeout=probe.left)[1].strip()
        rc, out, err = c.run(["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user[0]}",
                              "format=Account,Partition,QOS"], timeout=probe.left, check=False)  # fmt: skip
        if rc != 0:
            return Warn(f"sacctmgr failed: {(err or out).strip()[:200]} (no accounting database?)",
                        "associations not checked: sbatch says so if the account or QoS is refused")
        rows = [line.split("|") for line in out.splitlines() if line.count("|") >= 2]
        if not rows:
            return Warn(f"user {user[0]!r} has no associations", "ask the admins to add you to an account "
                        "(`sacctmgr add user NAME account=ACCOUNT`) if the cluster enforces them")
        accounts = {r[0]: {q for q in r[2].split(",") if q} for r in rows}
        if c.account is not None and c.account not in accounts:
            raise CheckFailed(f"user {user[0]!r} is not in account {c.account!r}; their accounts: "
                              f"{', '.join(accounts)}", f"set account to one of: {', '.join(accounts)}")  # fmt: skip
        allowed = accounts.get(c.account, set()) if c.account else set().union(*accounts.values())
        if c.qos is not None and c.qos not in allowed:
            raise CheckFailed(f"QoS {c.qos!r} is not allowed for {user[0]!r}; allowed: {', '.join(sorted(allowed))}",
                              f"set qos to one of: {', '.join(sorted(allowed)) or '(none)'}")  # fmt: skip
        return "; ".join(f"account {a}: QoS {', '.join(sorted(q)) or '-'}" for a, q in accounts.items())

    probe.step("account/QoS", associations)

    def runtime() -> Any:
        try:
            found_runtime = c.job_container_runtime()
        except ConfigurationError as exc:
            if probe.needs_image:
                raise
            return f"none ({exc.__class__.__name__}); not needed: the stack builds no image"
        mode = "auto-detected" if c.container_runtime == "auto" else "set"
        return f"{found_runtime} ({mode}){'' if probe.needs_image else '; not needed: the stack builds no image'}"

    probe.step("container runtime", runtime, "install pyxis, podman or apptainer on the nodes, or set container_runtime")
    if not probe.needs_image:

        def python() -> str:
            _, out, err = c.run([c.python, "--version"], timeout=probe.left)
            return f"{c.python}: {(out or err).strip()}"

        probe.step("python", python, "set python to an interpreter on the cluster's shared filesystem")

    root = c.workdir_root or c.job_workdir("x").rsplit("/", 1)[0]

    def workdir() -> str:
        script = 'd="$1"; while [ ! -d "$d" ]; do d=$(dirname "$d"); done; test -w "$d" && echo "$d"'
        rc, out, _ = c.run(["sh", "-c", script, "sh", root], timeout=probe.left, check=False)
        if rc != 0:
            raise CheckFailed(f"{root}: its nearest existing directory ({out.strip() or '?'}) is not writable by the user")
        return f"{root} ({'exists' if out.strip() == root else 'created by the first job under ' + out.strip()})"

    probe.step("jobs' directory", workdir, "set workdir_root to a directory on the shared filesystem the user may write")


def check_ssh_hosts(hosts: SshHosts, probe: Probe) -> None:
    """SSH reach, host key and login of every host (in order: each has the rest of the deadline)."""
    for host in hosts.hosts:
        client = ssh_rows(
            probe, host=host.address, port=host.port, user=host.user, key_text=hosts.private_key.get_secret_value(),
            passphrase=hosts.private_key_passphrase.get_secret_value() if hosts.private_key_passphrase else None,
            known_hosts=hosts.known_hosts, label=host.node_name,
        )  # fmt: skip
        if client is not None:
            client.close()
