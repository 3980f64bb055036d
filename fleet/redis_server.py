"""Finding a Redis: REDIS_URL, else one answering on 127.0.0.1:6379, else a
private `redis-server` started from PATH."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import redis


class NoRedis(Exception):
    pass


HOW_TO_GET_ONE = (
    "no Redis found: REDIS_URL is unset, nothing answers on 127.0.0.1:6379, and redis-server is not on PATH.\n"
    "Install one (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis) "
    "or point REDIS_URL at an existing server, e.g. REDIS_URL=redis://host:6379/0"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(url: str, timeout: float = 0.5) -> bool:
    """A Redis answers PING at `url` within `timeout` seconds."""
    from fleet.store.connection import connect_sync

    try:
        r = connect_sync(url, connect_timeout_s=timeout, read_timeout_s=timeout, retries=0)
        try:
            return bool(r.ping())
        finally:
            r.close()
    except (redis.ConnectionError, redis.TimeoutError, OSError, ValueError):
        return False


@dataclass
class PrivateRedis:
    """A throwaway redis-server on a free loopback port; nothing kept on disk."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    dir: str = ""
    replica_of: int | None = None  # a replica of the server on this loopback port (tests, benches)
    persist: bool = False  # keep every write (AOF, fsync always) in `dir`: a restart on it loads them
    own_group: bool = False  # a process group of its own: a terminal's Ctrl-C does not stop it under its owner

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> PrivateRedis:
        exe = shutil.which("redis-server")
        if not exe:
            raise NoRedis(HOW_TO_GET_ONE)
        self.dir = self.dir or tempfile.mkdtemp(prefix="fleet-redis-")
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *aof,
             "--dir", self.dir, "--maxclients", "10000",
             *(["--replicaof", "127.0.0.1", str(self.replica_of)] if self.replica_of else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0 if self.own_group else None)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if answers(self.url, 0.2):
                return self
            if self.proc.poll() is not None:
                raise NoRedis(f"redis-server exited with code {self.proc.returncode} on port {self.port}")
            time.sleep(0.05)
        raise NoRedis(f"redis-server did not answer on port {self.port} within {timeout:.0f}s")

    def stop(self, keep_data: bool = False) -> None:
        """Stop the server; its folder goes too unless `keep_data` (to start it again on the same)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if not keep_data:
            shutil.rmtree(self.dir, ignore_errors=True)


def resolve_redis(wait_s: float = 0.0, *, own_group: bool = False) -> tuple[str, PrivateRedis | None]:
    """The Redis URL to use, and the private server if one had to be started (`own_group`: in a
    process group of its own, as `fleet up` starts it, so that it serves its parts until they have
    drained). A REDIS_URL that does not answer is tried again for `wait_s` seconds first: a part
    started while its Redis restarts (as `fleet up` starts them) waits for it rather than exiting."""
    url = os.environ.get("REDIS_URL")
    if url:
        end = time.monotonic() + wait_s
        while not answers(url, 2.0):
            if time.monotonic() >= end:
                raise NoRedis(f"REDIS_URL={url} does not answer" + (f" within {wait_s:.0f} s" if wait_s else ""))
            time.sleep(0.5)
        return url, None
    local = "redis://127.0.0.1:6379/0"
    if answers(local):
        return local, None
    private = PrivateRedis(own_group=own_group).start()
    return private.url, private
