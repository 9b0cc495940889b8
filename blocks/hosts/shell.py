"""Commands on one of your own hosts (``SshHosts``), over its ``SshSession``: argv lists, changes via sudo.

``HostShell`` adds to the session what working on a host needs: commands that change the host go through
``sudo -n`` when the user is not root (and the block asks for it), every failure names the host, and
``check`` turns a failed command into a ``ConfigurationError`` with the command, its output and the fix.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from blocks.errors import ConfigurationError, TransientError
from blocks.ssh.session import TRANSPORT_ERRORS, SshSession


class HostShell:
    """One host's commands (see the module's docstring)."""

    def __init__(self, session: SshSession, node_name: str, *, sudo: bool) -> None:
        self.session, self.node_name, self.sudo = session, node_name, sudo

    def run(self, argv: Sequence[str], *, change: bool = False, stdin: bytes | None = None) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); ``change``: a command that changes the host (via sudo -n when not root);
        ``stdin``: bytes written to the command's standard input (how secrets reach a host)."""
        return self.run_all([argv], change=change, stdin=stdin)[0]

    def run_all(
        self, argvs: Sequence[Sequence[str]], *, change: bool = False, stdin: bytes | None = None
    ) -> list[tuple[int, str, str]]:
        """Several commands at once, one SSH channel each (login shells can be slow to start)."""
        commands = [list(a) for a in argvs]
        if change and self.sudo and self.session.user != "root":
            commands = [["sudo", "-n", "--", *a] for a in commands]
        try:
            return self.session.run_all(commands, stdin=stdin)
        except TRANSPORT_ERRORS as exc:
            raise TransientError(
                f"{self.node_name}: the SSH connection failed running "
                f"{', '.join(a[0] for a in commands)}: {exc or type(exc).__name__}"
            ) from exc

    def check(
        self, argv: Sequence[str], what: str, fix: str, *, change: bool = False, stdin: bytes | None = None
    ) -> str:
        rc, out, err = self.run(argv, change=change, stdin=stdin)
        if rc != 0:
            raise ConfigurationError(
                f"{self.node_name}: {what} failed (`{shlex.join(argv)}` exit {rc}: "
                f"{(err or out).strip()[-500:] or 'no output'}). Fix: {fix}"
            )
        return out

    def close(self) -> None:
        self.session.close()
