"""A real Redis Cluster for the tests: 3 masters + 3 replicas of `redis-server
--cluster-enabled yes` on free loopback ports, joined by `redis-cli --cluster create`.
Nothing is kept on disk; everything it starts, it stops."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import redis

from fleet.redis_server import NoRedis, free_port

NODE_TIMEOUT_MS = 1500  # how long a silent master lasts before its replica takes over


@dataclass
class ClusterNodeProc:
    port: int
    bus_port: int
    proc: subprocess.Popen[bytes]

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class PrivateCluster:
    masters: int = 3
    replicas: int = 1
    nodes: list[ClusterNodeProc] = field(default_factory=list)
    dir: str = ""

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 60.0) -> PrivateCluster:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if not exe or not cli:
            raise NoRedis("redis-server and redis-cli are needed for the cluster tests")
        self.dir = tempfile.mkdtemp(prefix="fleet-cluster-")
        for i in range(self.masters * (1 + self.replicas)):
            self.nodes.append(self._spawn(exe, i))
        end = time.monotonic() + timeout
        for i, n in enumerate(self.nodes):
            respawns = 0
            while not self._pings(n):
                if not n.alive() and respawns < 3:
                    # A free port is free only when it is picked: another process (or this
                    # cluster's own bus port) can take it before redis-server binds it. Try others.
                    respawns += 1
                    n = self.nodes[i] = self._spawn(exe, i)
                elif time.monotonic() > end or not n.alive():
                    self.stop()
                    raise NoRedis(f"cluster node on port {n.port} did not start")
                time.sleep(0.05)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)
        while not self.healthy():
            if time.monotonic() > end:
                self.stop()
                raise NoRedis("the cluster did not reach cluster_state:ok with every replica in sync")
            time.sleep(0.1)
        return self

    def _spawn(self, exe: str, i: int) -> ClusterNodeProc:
        """One cluster node on a client port and a bus port that no other node of this cluster holds."""
        taken = {p for n in self.nodes for p in (n.port, n.bus_port)}
        port = bus = 0
        while port in taken or bus in taken or port == bus:
            port, bus = free_port(), free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--cluster-port", str(bus), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", f"{self.dir}/nodes-{i}-{port}.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--maxclients", "10000",
             # A replica's first sync starts at once, not after the 5 s Redis waits by default for
             # more replicas to share one diskless transfer: each master here has one replica.
             "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return ClusterNodeProc(port, bus, proc)

    @staticmethod
    def _pings(n: ClusterNodeProc) -> bool:
        try:
            return bool(n.client().ping())
        except redis.RedisError:
            return False

    def roles(self) -> dict[int, str]:
        """port -> "master" / "slave" as each live node sees itself."""
        out = {}
        for n in self.nodes:
            if n.alive():
                with contextlib.suppress(redis.RedisError):
                    out[n.port] = n.client().info("replication")["role"]
        return out

    def healthy(self) -> bool:
        """Every live node reports cluster_state:ok and every replica's link is up."""
        try:
            for n in self.nodes:
                if not n.alive():
                    continue
                c = n.client()
                if c.cluster("info").get("cluster_state") != "ok":
                    return False
                rep = c.info("replication")
                if rep["role"] == "slave" and rep.get("master_link_status") != "up":
                    return False
            roles = self.roles()
            masters = [p for p, role in roles.items() if role == "master"]
            replicas = sum(1 for role in roles.values() if role == "slave")
            if len(masters) != self.masters:
                return False
            return all(self._knows_every_pairing(n.client(), replicas) for n in self.nodes if n.alive())
        except redis.RedisError:
            return False

    def _knows_every_pairing(self, c: redis.Redis, replicas: int) -> bool:
        """Node `c`'s own CLUSTER NODES names every master and each of the `replicas` live
        replicas with its master: a replica's link can be up before gossip has told the other
        nodes whose replica it is, and a test that looks a master's replica up (CLUSTER NODES)
        must find it. After a failover the promoted replica's master is gone and it has no
        replica of its own: the live replicas are counted, not masters x replicas."""
        rows = [ln.split() for ln in c.execute_command("CLUSTER", "NODES").decode().splitlines()]
        masters = {r[0] for r in rows if "master" in r[2] and "fail" not in r[2]}
        paired = [r for r in rows if "slave" in r[2] and "fail" not in r[2] and r[3] in masters]
        return len(masters) == self.masters and len(paired) == replicas

    def master_of(self, key: str) -> ClusterNodeProc:
        slot = self.nodes[0].client().cluster("keyslot", key)
        for n in self.nodes:
            if n.alive() and self.roles().get(n.port) == "master":
                for lo, hi, *_ in _slot_ranges(n):
                    if lo <= slot <= hi:
                        return n
        raise LookupError(f"no master serves slot {slot}")

    def replica_of(self, master: ClusterNodeProc) -> ClusterNodeProc:
        """The replica of `master` (CLUSTER NODES: the node whose master is its id)."""
        me = master.client().cluster("myid")
        me = me.decode() if isinstance(me, bytes) else me
        rows = [ln.split() for ln in master.client().execute_command("CLUSTER", "NODES").decode().splitlines()]
        port = next(int(r[1].split("@")[0].rsplit(":", 1)[1]) for r in rows if r[3] == me and "slave" in r[2])
        return next(n for n in self.nodes if n.port == port)

    def kill(self, node: ClusterNodeProc) -> None:
        node.proc.kill()
        node.proc.wait(10)

    def stop(self) -> None:
        for n in self.nodes:
            if n.alive():
                n.proc.terminate()
        for n in self.nodes:
            try:
                n.proc.wait(5)
            except subprocess.TimeoutExpired:
                n.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _slot_ranges(n: ClusterNodeProc) -> list[tuple[int, int]]:
    """The slot ranges node `n` serves as master (from its own CLUSTER SHARDS view)."""
    me = n.client().cluster("myid")
    me = me.decode() if isinstance(me, bytes) else me
    out = []
    for row in n.client().execute_command("CLUSTER", "SLOTS"):
        lo, hi, master = row[0], row[1], row[2]
        nid = master[2].decode() if isinstance(master[2], bytes) else master[2]
        if nid == me:
            out.append((int(lo), int(hi)))
    return out
