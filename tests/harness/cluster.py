"""A real local Redis Cluster for tests and benchmarks (nothing here ships in the ``mpflow`` package).

``with LocalCluster(tmp_dir) as cluster`` starts ``primaries × (1 + replicas)`` ``redis-server`` processes on free
loopback ports (``--cluster-enabled yes``, a short ``cluster-node-timeout`` so that a killed primary's replica is
promoted within about a second), joins them with ``redis-cli --cluster create ... --cluster-replicas N
--cluster-yes``, and yields once every node reports ``cluster_state:ok`` and knows every other node. On exit —
also when the body raised — every node is killed and its directory removed. ``cluster.url`` is one node's
``redis://`` URL: what ``MPFLOW_REDIS_URL`` is set to (the service finds the rest of the cluster from it).

Faults, for the fault script: :meth:`LocalCluster.kill` (SIGKILL a node), :meth:`LocalCluster.pause` and
:meth:`LocalCluster.resume` (SIGSTOP, SIGCONT), :meth:`LocalCluster.wait_promoted`
(a replica took over the killed primary's slots), :meth:`LocalCluster.restart` (the killed node rejoins, as a
replica), :meth:`LocalCluster.reshard` (``redis-cli --cluster reshard``: move slots between primaries while
clients run) and :meth:`LocalCluster.keys_per_primary`.

Each node is a process group of its own, known to :func:`tests.harness.server.kill_started` as well.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.harness.server import _STARTED

#: milliseconds without an answer after which the cluster fails a node over (Redis' default is 15000)
NODE_TIMEOUT_MS = 1000
START_TIMEOUT_S = 30.0


def cluster_binaries() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)`` on PATH when the server is Redis ≥ 7 (sharded pub/sub); else None."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        return None
    out = subprocess.run([server, "--version"], capture_output=True, text=True, check=False).stdout
    version = out.partition("v=")[2].split(".", 1)[0]
    return (server, cli) if version.isdigit() and int(version) >= 7 else None


def _free_node_port(taken: set[int]) -> int:
    """A loopback port whose cluster-bus port (port + 10000) is free as well."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in taken or port + 10000 in taken:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 10000))
            return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalCluster:
    """``primaries`` primaries with ``replicas`` replicas each on 127.0.0.1 (module docstring)."""

    def __init__(
        self,
        base_dir: str | os.PathLike[str] | None = None,
        primaries: int = 3,
        replicas: int = 1,
        full_coverage: bool = True,
    ):
        found = cluster_binaries()
        if found is None:
            raise RuntimeError("a local Redis Cluster needs redis-server >= 7 and redis-cli on PATH")
        self.server_bin, self.cli_bin = found
        self.base_dir = Path(base_dir) if base_dir else None
        self.primaries, self.replicas = primaries, replicas
        #: Redis' ``cluster-require-full-coverage``: ``True`` (its default) stops every node's queries while any slot
        #: has no primary (during a failover), ``False`` lets the other shards serve on
        self.full_coverage = full_coverage
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen] = {}
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def url_of(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> LocalCluster:
        self._dir = Path(tempfile.mkdtemp(prefix="mpflow-cluster-", dir=self.base_dir))
        try:
            taken: set[int] = set()
            for _ in range(self.primaries * (1 + self.replicas)):
                port = _free_node_port(taken)
                taken |= {port, port + 10000}
                self.ports.append(port)
                self._spawn(port)
            for port in self.ports:
                self._wait_answers(port)
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            subprocess.run(
                [
                    self.cli_bin,
                    "--cluster",
                    "create",
                    *nodes,
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=START_TIMEOUT_S,
            )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, port: int) -> None:
        assert self._dir is not None
        node_dir = self._dir / str(port)
        node_dir.mkdir(exist_ok=True)
        cmd = [
            self.server_bin,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(node_dir),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "yes" if self.full_coverage else "no",
            "--repl-diskless-sync-delay", "0",  # a replica's first sync at once (Redis waits 5 s for others)
            "--appendonly", "no",
            "--save", "",
            "--logfile", "redis.log",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _STARTED.add(proc)
        self.procs[port] = proc

    def stop(self) -> None:
        """Kill every node (no data to keep) and remove the cluster's directory."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            _STARTED.discard(proc)
        self.procs.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ------------------------------------------------------------------ state
    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)

    def _wait_answers(self, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(redis.RedisError), self.node(port) as r:
                if r.ping():
                    return
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.02)

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def wait_ok(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every live node says ``cluster_state:ok``, covers all 16384 slots and agrees on the primaries,
        and every replica's link to its primary is up (so ``WAIT`` can be answered)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                views = set()
                for port in self.alive():
                    with self.node(port) as r:
                        info = r.cluster("info")
                        if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                            raise RuntimeError(f"node {port}: {info.get('cluster_state')}")
                        replication = r.info("replication")
                        if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                            raise RuntimeError(f"replica {port}: link to its primary down")
                        views.add(tuple(sorted(self._primary_ports(r))))
                if len(views) == 1:
                    return
            except (redis.RedisError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Redis Cluster did not reach cluster_state:ok: {self._state()}")
            time.sleep(0.05)

    def _state(self) -> dict[int, str]:
        """What each live node says (for an error message)."""
        said = {}
        for port in self.alive():
            try:
                with self.node(port) as r:
                    info, replication = r.cluster("info"), r.info("replication")
                said[port] = (
                    f"{info.get('cluster_state')} {replication.get('role')} {replication.get('master_link_status')}"
                )
            except redis.RedisError as exc:
                said[port] = str(exc)
        return said

    @staticmethod
    def _primary_ports(r: redis.Redis) -> list[int]:
        nodes = r.cluster("nodes")
        return [int(addr.split(":")[1].split("@")[0]) for addr, n in nodes.items() if _is_live_primary(n)]

    def primary_ports(self) -> list[int]:
        """The ports of the primaries that serve slots now (as a live node sees the cluster)."""
        with self.node(self.alive()[0]) as r:
            nodes = r.cluster("nodes")
        return [
            int(addr.split(":")[1].split("@")[0]) for addr, n in nodes.items() if _is_live_primary(n) and n["slots"]
        ]

    def keys_per_primary(self, match: str = "*") -> dict[int, int]:
        """``{port: number of keys matching match}`` over the primaries."""
        out = {}
        for port in self.primary_ports():
            with self.node(port) as r:
                out[port] = sum(1 for _ in r.scan_iter(match=match, count=1000))
        return out

    # ------------------------------------------------------------------ faults
    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: what it had not replicated yet is lost)."""
        proc = self.procs[port]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def pause(self, port: int) -> None:
        """SIGSTOP one node: it holds its connections and answers nothing (a stalled VM or a long GC pause)."""
        os.killpg(self.procs[port].pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT a paused node: it runs on with what it had, and learns from the others what changed meanwhile."""
        os.killpg(self.procs[port].pid, signal.SIGCONT)

    def replica_ports(self, primary: int) -> list[int]:
        """The ports of the nodes that replicate the primary on ``primary`` (as a live node sees the cluster)."""
        with self.node(self.alive()[0]) as r:
            nodes = r.cluster("nodes")
        ids = {n["node_id"]: int(addr.split(":")[1].split("@")[0]) for addr, n in nodes.items()}
        return [
            int(addr.split(":")[1].split("@")[0])
            for addr, n in nodes.items()
            if "slave" in n.get("flags", "") and ids.get(n.get("master_id")) == primary
        ]

    def slots_of(self, primary: int) -> list[int]:
        """The hash slots the primary on ``primary`` serves, in order."""
        with self.node(primary) as r:
            nodes = r.cluster("nodes")
        mine = next(n for n in nodes.values() if "myself" in n.get("flags", ""))
        slots: list[int] = []
        for start, end in (map(int, s) for s in mine["slots"]):
            slots.extend(range(start, end + 1))
        return slots

    def wait_promoted(self, dead_port: int, timeout: float = 30.0) -> None:
        """Until the cluster is ok again without ``dead_port`` serving slots (its replica took over)."""
        deadline = time.monotonic() + timeout
        while dead_port in self.primary_ports() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.wait_ok(max(1.0, deadline - time.monotonic()))

    def restart(self, port: int) -> None:
        """Start a killed node again on its nodes.conf: it rejoins (as a replica of its replacement)."""
        self._spawn(port)
        self._wait_answers(port)

    def reshard(self, sources: list[int], target: int, slots: int) -> None:
        """Move ``slots`` hash slots from the primaries on ``sources`` (in proportion to what they hold) to the one
        on ``target``, keys and all (``redis-cli --cluster reshard``)."""
        ids = {}
        for port in (*sources, target):
            with self.node(port) as r:
                ids[port] = r.execute_command("CLUSTER", "MYID").decode()
        cmd = [
            self.cli_bin, "--cluster", "reshard", f"127.0.0.1:{target}",
            "--cluster-from", ",".join(ids[p] for p in sources), "--cluster-to", ids[target],
            "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "100",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            said = [line for line in done.stdout.splitlines() if "ERR" in line or "WARN" in line]
            raise RuntimeError(f"redis-cli --cluster reshard failed ({done.returncode}): {said[-5:]}")


def _is_live_primary(node: dict) -> bool:
    flags = node.get("flags", "")
    return "master" in flags and "fail" not in flags and node.get("connected", True)


__all__ = ["NODE_TIMEOUT_MS", "LocalCluster", "cluster_binaries"]
