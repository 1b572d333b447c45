"""Safe defaults (issue 14): a server started without --host listens on loopback only, gRPC and
/metrics alike; reaching it from elsewhere takes an explicit --host (the Helm chart passes one).
Checked on the process's own listening sockets (/proc/PID/fd against /proc/net/tcp and tcp6)."""

from __future__ import annotations

import ipaddress
import os

from specpool.cluster.processes import start_server
from specpool.cluster.redis_server import start_redis
from tests.cluster.test_disaggregation import tiny_files


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                hex_ip, hex_port = local.split(":")
                # The kernel prints each 32-bit word of the address in host (little-endian) order.
                raw = b"".join(bytes.fromhex(hex_ip[i : i + 8])[::-1] for i in range(0, len(hex_ip), 8))
                ip = ipaddress.ip_address(raw)
                found.add((str(getattr(ip, "ipv4_mapped", None) or ip), int(hex_port, 16)))
    return found


def exposed(addresses: set[tuple[str, int]]) -> set[tuple[str, int]]:
    return {a for a in addresses if not ipaddress.ip_address(a[0]).is_loopback}


def test_servers_listen_on_loopback_unless_told_otherwise(tmp_path):
    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    redis = start_redis()
    servers = []
    try:
        servers.append(start_server("spec", ["serve-spec", "--port", "0", "--metrics-port", "0", "--threads", "1",
                                             "--drafter", f"tiny={gguf},draft={draft}"]))
        servers.append(start_server("target", ["serve-target", "--model", str(gguf), "--port", "0",
                                               "--metrics-port", "0", "--threads", "1", "--datastore", ""]))
        servers.append(start_server("router", ["serve-router", "--port", "0", "--metrics-port", "0",
                                               "--redis", redis.url]))
        for server in servers:
            addresses = listening(server.proc.pid)
            assert {server.port, server.metrics_port} <= {port for _, port in addresses}, (server.name, addresses)
            if server.name == "spec":  # its tensor-channel store: test_the_endpoints_tensor_store_... below
                addresses = {a for a in addresses if a[1] in (server.port, server.metrics_port)}
            assert not exposed(addresses), f"{server.name} listens beyond loopback: {sorted(exposed(addresses))}"
        told = start_server("target-any", ["serve-target", "--model", str(gguf), "--port", "0", "--metrics-port",
                                           "0", "--threads", "1", "--datastore", "", "--host", "0.0.0.0"])
        servers.append(told)
        wildcard = {(host, port) for host in ("0.0.0.0", "::") for port in (told.port, told.metrics_port)}
        assert {port for _, port in listening(told.proc.pid) & wildcard} == {told.port, told.metrics_port}
    finally:
        for server in servers:
            server.stop()
        redis.close()


def test_the_endpoints_tensor_store_listens_on_loopback_only(tmp_path):
    gguf, draft = tiny_files(tmp_path, vocab=64, seed=3)
    spec = start_server("spec", ["serve-spec", "--port", "0", "--metrics-port", "0", "--threads", "1",
                                 "--drafter", f"tiny={gguf},draft={draft}"])
    try:
        assert not exposed(listening(spec.proc.pid))
    finally:
        spec.stop()
