"""The router's gRPC channels to the members it forwards to and health-checks: one per member."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpool.common.security import Security
from specpool.common.serving import MESSAGE_SIZE_OPTIONS
from specpool_client.v1 import target_pb2_grpc

# gRPC's default reconnect backoff grows to 120 s: a member back on its address after a long absence
# would look down that long to requests and to direct health checks.
CHANNEL_OPTIONS = [*MESSAGE_SIZE_OPTIONS, ("grpc.max_reconnect_backoff_ms", 5000)]


class TargetChannels:
    """One channel per member, shared by all requests and health checks.

    A member is dialled as what the registry says is at its address (`name_of`: ("target", tenant) or
    ("endpoint", id)), and its certificate must name exactly that: anyone can write a heartbeat into
    Redis, only the cluster's CA can make a certificate for <tenant>.target.specpool.
    """

    def __init__(self, credentials: Security, name_of: Callable[[str], tuple[str, str] | None]):
        self.credentials = credentials
        self.name_of = name_of
        self._channels: dict[tuple[str, tuple[str, str] | None], grpc.Channel] = {}
        self._stubs: dict[tuple[str, tuple[str, str] | None], target_pb2_grpc.TargetServiceStub] = {}
        self._lock = threading.Lock()

    def channel(self, address: str) -> grpc.Channel:
        name = self.name_of(address)
        with self._lock:
            channel = self._channels.get((address, name))
            if channel is None:
                # Not in the registry (any more): expect a name no certificate carries.
                role, member = name or ("target", "unregistered")
                channel = self._channels[(address, name)] = self.credentials.channel(
                    address, role, member, options=CHANNEL_OPTIONS)
            return channel

    def stub(self, address: str) -> target_pb2_grpc.TargetServiceStub:
        key = (address, self.name_of(address))
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = target_pb2_grpc.TargetServiceStub(self.channel(address))
        return stub

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()

    def health_check(self, timeout_s: float) -> Callable[[list[str]], list[bool]]:
        """check(addresses) for DirectChecks: grpc.health.v1 Check of every address at once; True where
        it answered SERVING (a draining member answers NOT_SERVING) within timeout_s."""
        def check(addresses: list[str]) -> list[bool]:
            futures = [health_pb2_grpc.HealthStub(self.channel(a)).Check.future(
                health_pb2.HealthCheckRequest(), timeout=timeout_s) for a in addresses]
            return [_serving(f) for f in futures]

        return check


def _serving(future) -> bool:
    try:
        return future.result().status == health_pb2.HealthCheckResponse.SERVING
    except (grpc.RpcError, ValueError):  # ValueError: the channel was closed (shutting down)
        return False

