"""A real, throwaway redis-server for tests: a free loopback port, no persistence, killable.

    with RedisServer() as server:          # or RedisServer(cluster=True): a one-node Redis Cluster
        tier = RedisTier(server.url, ...)
        server.kill()                      # SIGKILL: an outage
        server.start()                     # back on the same port (empty, unless a cluster's slots)

Tests using it skip when no redis-server is installed.
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
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvgate.gateway.readiness import free_port


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server") or "/usr/bin/redis-server"
    return found if os.access(found, os.X_OK) else None


def node_port() -> int:
    """A free loopback port for a cluster node: one whose bus port (10000 higher) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 <= 65535:
            with socket.socket() as bus, contextlib.suppress(OSError):  # the bus port taken: another pair
                bus.bind(("127.0.0.1", port + 10000))
                return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    def __init__(self, cluster: bool = False, start_timeout_s: float = 10.0) -> None:
        binary = redis_server_binary()
        if binary is None:
            pytest.skip("redis-server is not installed (not on PATH, not /usr/bin/redis-server)")
        self.binary, self.cluster, self.start_timeout_s = binary, cluster, start_timeout_s
        self.port = node_port() if cluster else free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvgate-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        """A plain client to the node, for poking at it (in cluster mode: for keys of any slot)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self) -> RedisServer:
        """Start (again, on the same port) and wait until it answers; a cluster also until its state is ok."""
        assert self.process is None or self.process.poll() is not None, "already running"
        args = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")]
        if self.cluster:
            # The config file keeps the node's slots across a restart, as a real node's would.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf")]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        with self.client() as client:
            self._wait(lambda: client.ping())
            if self.cluster:
                if b"cluster_slots_assigned:0\r" in client.execute_command("CLUSTER", "INFO"):
                    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
                self._wait(lambda: b"cluster_state:ok\r" in client.execute_command("CLUSTER", "INFO"))
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as in a crash or a network outage."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait(self, ready: Callable[[], object]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self._log()}")
            try:
                if ready():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on {self.port} not up in {self.start_timeout_s}s: {self._log()}")
            time.sleep(0.02)

    def _log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-2000:]
        except OSError:
            return "(no log)"
