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
    from blocks.ssh_credentials import SshCredentials
    from blocks.ssh_hosts import SshHosts

_GRES_GPU = re.compile(r"^gpu(?::[^:()]+)?:(\d+)")


def ssh_rows(probe: Probe, *, host: str | None, port: int, credentials: SshCredentials | None,
             user: str | None = None, label: str = "") -> paramiko.SSHClient | None:  # fmt: skip
    """The rows SSH reach, host key and login of one host; the logged-in client, or None when one failed.
    ``user``: the host's own (default: the credentials')."""
    from blocks._ssh import fingerprint

    prefix = f"{label} " if label else ""
    user = user or (credentials.user if credentials is not None else None)
    key_text = credentials.private_key if credentials is not None else None
    if not host or not user or not key_text or credentials is None:
        missing = [n for n, v in (("host", host), ("credentials.user", user), ("credentials.private_key", key_text))
                   if not v]  # fmt: skip
        probe.add(f"{prefix}SSH", "failed", f"{', '.join(missing)} not set", "set them in the stack file")
        return None
    if not probe.step(f"{prefix}SSH reach", lambda: tcp_reach(host, port, probe.left),
                      "check host and port, and that this machine may reach the login node (VPN, firewall)"):
        return None
    login_fix = f"check user and private_key, and that the public key is in ~{user}/.ssh/authorized_keys"
    try:
        key = credentials.key()
    except ConfigurationError as exc:
        probe.add(f"{prefix}SSH login", "failed", str(exc), login_fix)
        return None
    client: list[Any] = []
    refused: list[str] = []

    def host_key() -> str:
        try:
            client.append(credentials.get_client(
                host, port, user=user, key=key, timeout=probe.left, name=f"{host}:{port}",
                check_against="matches the one the admins publish",
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
    missing = "`srun --help` lists no --container-image (no pyxis)" if runtime == "pyxis" else \
        f"no {runtime} on the login node's PATH"  # fmt: skip
    found = ", ".join(sorted(offered)) or "none"
    if not needed:
        return Warn(f"container_runtime={runtime!r}, but {missing} (offered: {found}){note}",
                    "set container_runtime to auto, or to one the cluster has")  # fmt: skip
    other = f", or set container_runtime to {' or '.join([*sorted(offered), 'auto'])}" if offered else ""
    raise CheckFailed(f"container_runtime={runtime!r}, but {missing}; the cluster offers: {found}",
                      f"install {runtime} on the nodes{other}")


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

    if not probe.step("Slurm version", version, "install the Slurm client commands on the login node, or fix "
                      "slurm_conf; `sinfo --version` must work there"):
        return
    found: dict[str, dict[str, Any]] = {}

    def partitions() -> Any:
        found.update(_partitions(section("partitions", "`sinfo` must work on the login node")))
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
    user = facts.get("user", (0, c.user or "?"))[1]

    def associations() -> Any:
        rc, out = facts.get("assoc", (1, "no answer"))
        if rc != 0:
            return Warn(f"sacctmgr failed: {out[:200]} (no accounting database?)",
                        "associations not checked: sbatch says so if the account or QoS is refused")
        accounts = _accounts(out)
        if not accounts:
            return Warn(f"user {user!r} has no associations", "ask the admins to add you to an account "
                        "(`sacctmgr add user NAME account=ACCOUNT`) if the cluster enforces them")
        if c.account is not None and c.account not in accounts:
            raise CheckFailed(f"user {user!r} is not in account {c.account!r}; their accounts: "
                              f"{', '.join(accounts)}", f"set account to one of: {', '.join(accounts)}")  # fmt: skip
        allowed = accounts.get(c.account, set()) if c.account else set().union(*accounts.values())
        if c.qos is not None and c.qos not in allowed:
            raise CheckFailed(f"QoS {c.qos!r} is not allowed for {user!r}; allowed: {', '.join(sorted(allowed))}",
                              f"set qos to one of: {', '.join(sorted(allowed)) or '(none)'}")  # fmt: skip
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

    probe.step("container runtime", runtime, "install pyxis, podman or apptainer on the nodes, or set container_runtime")
    if not probe.needs_image:
        probe.step("python", lambda: f"{c.python}: {section('python', '')}",
                   "set python to an interpreter on the cluster's shared filesystem")

    def workdir() -> str:
        rc, out = facts.get("workdir", (1, "?"))
        if rc != 0:
            raise CheckFailed(f"{root}: its nearest existing directory ({out or '?'}) is not writable by {user}")
        return f"{root} ({'exists' if out == root else 'created by the first job under ' + out})"

    probe.step("jobs' directory", workdir, "set workdir_root to a directory on the shared filesystem the user may write")


def check_ssh_hosts(hosts: SshHosts, probe: Probe) -> None:
    """SSH reach, host key and login of every host (in order: each has the rest of the deadline)."""
    for host in hosts.hosts:
        client = ssh_rows(probe, host=host.address, port=host.port, credentials=hosts.credentials,
                          user=hosts.user_of(host), label=host.node_name)  # fmt: skip
        if client is not None:
            client.close()
