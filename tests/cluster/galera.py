"""A real MariaDB Galera cluster on loopback: three ``mariadbd`` processes under a temp dir.

Used by the cluster tests (one session-scoped cluster, ``tests/cluster/conftest.py``), and
runnable by hand to try things out or to feed ``make bench``::

    .venv/bin/python -m tests.cluster.galera up --dir /tmp/nfr-galera   # prints the URLs
    .venv/bin/python -m tests.cluster.galera down --dir /tmp/nfr-galera

``galera-4`` and ``rsync`` come with Debian's ``mariadb-server``. Facts this harness is
built around (``../shared/TOOLING.md``): node 1 bootstraps the cluster
(``--wsrep-new-cluster``), the others join it and receive a full state transfer (SST,
rsync); the rsync daemon of an SST runs as ``nobody``, so every data dir must be
world-writable (``UMASK``/``UMASK_DIR`` and a zero process umask make the server create
its files that way, and a ``chmod`` before every start covers the rest). A node killed
with SIGKILL rejoins with another SST into an emptied data dir (a crashed node does not
know its position). Failure detection keeps Galera's default timeouts: a SIGKILLed node's
connections close at once, so it is evicted within seconds anyway, and shorter
``evs.*`` timeouts make healthy nodes suspect each other on a loaded machine (a node
starved of CPU misses keepalives, the others lose their quorum).

Every port (SQL, group communication, IST, SST) is a free loopback port picked at start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pymysql

__all__ = ["GALERA_PROVIDER", "GaleraCluster", "GaleraNode", "missing_requirements"]

GALERA_PROVIDER = "/usr/lib/galera/libgalera_smm.so"
_CLUSTER_NAME = "nfr-test"
_START_TIMEOUT_S = 180.0

#: Server options of every node: small buffers (three servers share a small machine),
#: utf8mb4, and the Galera requirements (ROW binlog format, interleaved auto-increment
#: locks, InnoDB). ``innodb_flush_log_at_trx_commit=2`` writes the redo log at COMMIT
#: and syncs once a second: a SIGKILLed *process* loses nothing (the OS holds the
#: write), and durability across machines is Galera's replication.
_SERVER_OPTIONS = (
    "--binlog-format=ROW",
    "--default-storage-engine=InnoDB",
    "--innodb-autoinc-lock-mode=2",
    "--innodb-buffer-pool-size=64M",
    "--innodb-log-file-size=16M",
    "--innodb-flush-log-at-trx-commit=2",
    "--character-set-server=utf8mb4",
    "--max-connections=400",
    "--skip-name-resolve",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_requirements() -> str | None:
    """Why a Galera cluster cannot start on this machine, or ``None`` when it can."""
    for tool in ("mariadbd", "mariadb-install-db", "rsync"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install mariadb-server)"
    if not Path(GALERA_PROVIDER).exists():
        return f"{GALERA_PROVIDER} is missing (apt-get install galera-4)"
    return None


@dataclass
class GaleraNode:
    """One ``mariadbd`` of the cluster."""

    index: int
    base: Path
    sql_port: int = field(default_factory=_free_port)
    group_port: int = field(default_factory=_free_port)
    ist_port: int = field(default_factory=_free_port)
    sst_port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"n{self.index + 1}"

    @property
    def datadir(self) -> Path:
        return self.base / self.name

    @property
    def error_log(self) -> Path:
        return self.base / f"{self.name}.err"

    @property
    def group_address(self) -> str:
        return f"127.0.0.1:{self.group_port}"

    def server_url(self) -> str:
        """``mysql+asyncmy`` URL of this node without a database."""
        return f"mysql+asyncmy://root:@127.0.0.1:{self.sql_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, cluster_address: str, *extra: str) -> list[str]:
        provider_options = ";".join(
            (
                f"gmcast.listen_addr=tcp://{self.group_address}",
                f"ist.recv_addr=127.0.0.1:{self.ist_port}",
                "gcache.size=64M",
            )
        )
        return [
            "mariadbd",
            "--no-defaults",
            f"--datadir={self.datadir}",
            f"--socket={self.base / (self.name + '.sock')}",
            f"--port={self.sql_port}",
            "--bind-address=127.0.0.1",
            f"--pid-file={self.base / (self.name + '.pid')}",
            "--user=root",
            f"--log-error={self.error_log}",
            *_SERVER_OPTIONS,
            "--wsrep-on=ON",
            f"--wsrep-provider={GALERA_PROVIDER}",
            f"--wsrep-cluster-name={_CLUSTER_NAME}",
            f"--wsrep-cluster-address={cluster_address}",
            f"--wsrep-node-address={self.group_address}",
            f"--wsrep-node-name={self.name}",
            f"--wsrep-provider-options={provider_options}",
            "--wsrep-sst-method=rsync",
            f"--wsrep-sst-receive-address=127.0.0.1:{self.sst_port}",
            *extra,
        ]

    def connect(self, timeout_s: float = 3.0) -> pymysql.connections.Connection:  # type: ignore[type-arg]
        return pymysql.connect(
            host="127.0.0.1",
            port=self.sql_port,
            user="root",
            password="",
            charset="utf8mb4",
            autocommit=True,
            connect_timeout=max(1, int(timeout_s)),
            read_timeout=30,
            write_timeout=30,
        )

    def status(self) -> dict[str, str]:
        """``SHOW GLOBAL STATUS LIKE 'wsrep%'`` of this node."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS LIKE 'wsrep%'")
                return {str(k): str(v) for k, v in cur.fetchall()}
        finally:
            conn.close()


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that forked it ends (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _chmod_world_writable(path: Path) -> None:
    """What the rsync SST daemon (running as ``nobody``) needs on a joiner's data dir."""
    for root, dirs, files in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, name), 0o777)
        for name in files:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, name), 0o666)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o777)


class GaleraCluster:
    """A ``size``-node Galera cluster on loopback under ``base`` (see the module docstring).

    Args:
        base: an empty (or absent) directory the cluster owns.
        size: number of nodes (3 for the tests).
    """

    def __init__(self, base: Path, size: int = 3, *, tie_to_parent: bool = True) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one node")
        self.base = base
        self.nodes = [GaleraNode(i, base) for i in range(size)]
        self._env = {**os.environ, "UMASK": "0666", "UMASK_DIR": "0777"}
        # Every node is started from this one thread, which lives until stop(): with
        # tie_to_parent a node gets SIGKILL when that thread (i.e. the test process)
        # dies, so a killed test run leaves no server behind.
        self._tie = tie_to_parent
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="galera-spawn")

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Initialise the data dirs, bootstrap node 1, join the others; wait until all are
        ``Synced`` in one primary component of ``size`` nodes.

        Raises:
            RuntimeError: a node exited or the cluster did not form in time (with the
                tail of its error log).
        """
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o777)
        # Only the bootstrap node needs system tables: a joiner's first state transfer
        # (rsync, before the storage engines start) fills its empty data dir.
        for node in self.nodes[:1]:
            subprocess.run(
                [
                    "mariadb-install-db",
                    "--no-defaults",
                    f"--datadir={node.datadir}",
                    "--user=root",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    "--innodb-log-file-size=16M",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=self._env,
                timeout=120,
            )
        deadline = time.monotonic() + timeout_s
        first = self.nodes[0]
        self._spawn(first, "gcomm://", "--wsrep-new-cluster")
        self._wait_synced(first, deadline)
        for node in self.nodes[1:]:
            node.datadir.mkdir(parents=True, exist_ok=True)
            # One joiner at a time: a donor serves one state transfer, and a joiner that
            # finds none free waits seconds before it asks again.
            self._spawn(node, f"gcomm://{first.group_address}")
            self._wait_synced(node, deadline)
        self._wait_size(len(self.nodes), deadline)

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after a grace period)."""
        for node in self.nodes:
            if node.alive():
                assert node.proc is not None
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait(timeout=30)
        self._spawner.shutdown(wait=True)

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (a crash: no shutdown, no goodbye to the group)."""
        node = self.nodes[index]
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(timeout=30)

    def restart(self, index: int, timeout_s: float = 120.0) -> None:
        """Start a stopped or killed node again; it rejoins through the live nodes and is
        ``Synced`` when this returns."""
        node = self.nodes[index]
        if node.alive():
            raise RuntimeError(f"{node.name} is still running")
        peers = ",".join(n.group_address for n in self.nodes if n is not node and n.alive())
        if not peers:
            raise RuntimeError("no live node to rejoin through")
        deadline = time.monotonic() + timeout_s
        # Let the survivors evict the dead incarnation first: a joiner that arrives while
        # it is still a member makes a four-member component, and losing one more node
        # then leaves no majority.
        self._wait_size(sum(1 for n in self.nodes if n.alive()), deadline)
        # A crashed node does not know its position (grastate seqno -1) and gets a full
        # state transfer anyway; an empty data dir also spares the rsync daemon (nobody)
        # from re-owning root's directories, which it may not (chgrp: EPERM).
        shutil.rmtree(node.datadir, ignore_errors=True)
        node.datadir.mkdir(parents=True)
        self._spawn(node, f"gcomm://{peers}")
        self._wait_synced(node, deadline)
        self._wait_size(sum(1 for n in self.nodes if n.alive()), deadline)

    def wait_size(self, size: int, timeout_s: float = 60.0) -> None:
        """Wait until every live node reports a primary component of ``size`` nodes."""
        self._wait_size(size, time.monotonic() + timeout_s)

    # --- reading -------------------------------------------------------------------------

    def server_urls(self) -> list[str]:
        """The ``mysql+asyncmy`` server URL of every node, in node order."""
        return [n.server_url() for n in self.nodes]

    def describe(self) -> dict[str, object]:
        return {
            "base": str(self.base),
            "nodes": [
                {"name": n.name, "url": n.server_url(), "pid": n.proc.pid if n.proc else None}
                for n in self.nodes
            ],
        }

    def log_tail(self, index: int, lines: int = 40) -> str:
        path = self.nodes[index].error_log
        if not path.exists():
            return ""
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(line for line in text[-lines:] if "max_open_files" not in line)

    # --- internals -----------------------------------------------------------------------

    def _tails(self, skip: GaleraNode | None = None) -> str:
        """The last error-log lines of every node but ``skip`` (for failure messages)."""
        return "\n".join(
            f"--- {n.name}\n{self.log_tail(n.index, 15)}" for n in self.nodes if n is not skip
        )

    def _spawn(self, node: GaleraNode, cluster_address: str, *extra: str) -> None:
        _chmod_world_writable(self.base)
        command = node.command(cluster_address, *extra)
        node.proc = self._spawner.submit(self._popen, command).result()

    def _popen(self, command: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self._env,
            umask=0,  # with UMASK/UMASK_DIR: every file the server creates is world-writable
            start_new_session=True,  # a Ctrl-C of the test run must not kill the nodes first
            preexec_fn=_die_with_parent if self._tie else None,
        )

    def _wait_synced(self, node: GaleraNode, deadline: float) -> None:
        last: object = None
        while time.monotonic() < deadline:
            if not node.alive():
                raise RuntimeError(
                    f"{node.name} exited while starting:\n{self.log_tail(node.index)}"
                    f"\n{self._tails(node)}"
                )
            try:
                status = node.status()
                if (
                    status.get("wsrep_local_state_comment") == "Synced"
                    and status.get("wsrep_ready") == "ON"
                ):
                    return
                last = status.get("wsrep_local_state_comment")
            except pymysql.err.MySQLError as exc:
                last = exc
            time.sleep(0.1)
        raise RuntimeError(
            f"{node.name} not Synced in time (last: {last!r}):\n{self.log_tail(node.index)}"
            f"\n{self._tails(node)}"
        )

    def _wait_size(self, size: int, deadline: float) -> None:
        last: object = None
        while time.monotonic() < deadline:
            try:
                sizes = {
                    n.name: (n.status().get("wsrep_cluster_size"), n.status().get("wsrep_ready"))
                    for n in self.nodes
                    if n.alive()
                }
                if all(s == (str(size), "ON") for s in sizes.values()):
                    return
                last = sizes
            except pymysql.err.MySQLError as exc:
                last = exc
            time.sleep(0.1)
        raise RuntimeError(
            f"cluster did not settle at {size} nodes (last: {last!r})\n{self._tails()}"
        )


@contextlib.contextmanager
def running_cluster(base: Path, size: int = 3) -> Iterator[GaleraCluster]:
    """Start a cluster, yield it, stop it (the data dir stays for post-mortems)."""
    cluster = GaleraCluster(base, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``up`` starts a cluster and leaves it running (prints its URLs as JSON);
    ``down`` stops the cluster a previous ``up`` started in the same ``--dir``."""
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.galera")
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--size", type=int, default=3)
    args = parser.parse_args(argv)
    reason = missing_requirements()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    state = args.dir / "cluster.json"
    if args.action == "up":
        cluster = GaleraCluster(args.dir, args.size, tie_to_parent=False)
        cluster.start()
        info = cluster.describe()
        state.write_text(json.dumps(info, indent=2), encoding="utf-8")
        print(json.dumps(info, indent=2))
        print("FLOW_BENCH_CLUSTER_URLS=" + ",".join(cluster.server_urls()))
        return 0
    info = json.loads(state.read_text(encoding="utf-8"))
    for node in info["nodes"]:
        if node["pid"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(node["pid"]), signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
