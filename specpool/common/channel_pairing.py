"""How two processes become a tensor-channel pair: the rendezvous store, the 2-rank group, and the
proof that the peer holds the pair's secret.

The store is reachable by anyone who reaches its port, and anyone there can list its keys and join
a pair. So each offer carries a fresh random secret that only travels over the (authenticated) gRPC
call, never through the store: once the group forms, each rank proves it holds the secret
(HMAC-SHA256 over the other rank's random nonce) before the channel is used, and a peer that cannot
is refused. Prefixes are random and name no peer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from specpool.engine.runtime.device import distributed_backend

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_SECRET_BYTES = 32  # per offer
_NONCE_BYTES = 32  # per rank per handshake
_PROOF_BYTES = hashlib.sha256().digest_size


class PeerRefused(Exception):
    """The peer in the group did not prove the pair's secret."""


def new_secret() -> bytes:
    return secrets.token_bytes(_SECRET_BYTES)


# -- the store ---------------------------------------------------------------------------------------


def serve_store(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """The rendezvous store's server, listening on host only (a wildcard host: every interface) and port
    (0: an ephemeral one), and the address this process reaches it on."""
    # Where this process reaches its own store (the master store and each rank 0 connect to it).
    local_host = _loopback_for(host) if host in WILDCARD_HOSTS else host
    with _listening_socket(host, port) as listener:
        # The store's server takes the descriptor over (and closes it, on failure too): hand it a copy.
        store = dist.TCPStore(
            local_host, listener.getsockname()[1], is_master=True,
            timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
            master_listen_fd=os.dup(listener.fileno()),
        )
    return store, local_host


def join_store(host: str, port: int, prefix: str, timeout_s: float) -> dist.Store:
    """A connection of its own to the store at host:port, under one pair's prefix."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port only; a wildcard host ("", 0.0.0.0, ::) means every interface.

    torch's TCPStore, handed a host, still binds every interface: it gets this socket instead.
    """
    if host in WILDCARD_HOSTS:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("::", port), family=socket.AF_INET6, backlog=128,
                                        dualstack_ipv6=True)
        return socket.create_server(("0.0.0.0", port), family=socket.AF_INET, backlog=128)
    errors = []
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse a fixed port
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(128)
            return sock
        except OSError as e:
            sock.close()
            errors.append(e)
    raise OSError(f"cannot listen on {host}:{port}: {errors[-1] if errors else 'the host has no address'}")


def _loopback_for(wildcard: str) -> str:
    """A loopback address the wildcard listener accepts: IPv4's, unless the machine has only IPv6."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
        return "127.0.0.1"
    except OSError:
        return "::1"


def local_address_towards(host: str, port: int) -> str | None:
    """The local address whose interface routes to host: the one the peer can reach us on."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # UDP: picks a route, sends nothing
            return probe.getsockname()[0]
    except OSError:
        return None


# -- the group ---------------------------------------------------------------------------------------


def check_backend(backend: str, device: torch.device, name: str) -> None:
    if distributed_backend(device) != backend:
        raise ValueError(
            f"tensor channel {name}: the offer uses {backend!r}, which cannot carry tensors on {device} "
            f"({device} uses {distributed_backend(device)!r}); pass a matching device"
        )


def new_group(
    store: dist.Store, rank: int, backend: str, timeout: timedelta, local_host: str | None
) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """A 2-rank backend built from the store; the constructor returns once both ranks have joined (Gloo)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        # An explicit address: the default device resolves the machine's hostname, which may not resolve.
        if local_host is None or local_host in WILDCARD_HOSTS:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        else:
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        options._timeout = timeout
        options._threads = 2
        return dist.ProcessGroupGloo(store, rank, 2, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"tensor channel backend must be gloo or nccl; got {backend!r}")


def connect_error(e: Exception, name: str, rank: int, timeout_s: float, via: str) -> Exception:
    message = f"tensor channel {name}: rank {rank} did not pair with rank {1 - rank} ({via}, {timeout_s:g}s)"
    message += f": {e}"
    text = str(e).lower()
    if isinstance(e, TimeoutError | dist.DistStoreError) or "timeout" in text or "timed out" in text:
        return TimeoutError(message)
    return RuntimeError(message)


# -- the proof of the secret -------------------------------------------------------------------------


def prove_secret(secret: bytes, rank: int, send: Callable[[bytes], None], recv: Callable[[int], bytes]) -> None:
    """Mutual proof of the pair's secret over the new group (send/recv), before it carries anything else.

    Each rank sends a fresh random nonce; each answers HMAC-SHA256(secret, b"rank<own rank>" + the
    other's nonce), which only a holder of the secret can compute and which is good for this handshake
    only (the rank in it keeps a peer from echoing our own proof back). The joining rank (1) proves
    first; rank 0 answers only a peer that proved, so an impostor at rank 1 sees no proof at all. A peer
    whose proof does not match raises PeerRefused.
    """
    peer_rank = 1 - rank
    own_nonce = secrets.token_bytes(_NONCE_BYTES)
    if rank == 0:
        send(own_nonce)
        peer_nonce = recv(_NONCE_BYTES)
        _check_proof(secret, peer_rank, own_nonce, recv(_PROOF_BYTES))
        send(_proof(secret, rank, peer_nonce))
    else:
        peer_nonce = recv(_NONCE_BYTES)
        send(own_nonce)
        send(_proof(secret, rank, peer_nonce))
        _check_proof(secret, peer_rank, own_nonce, recv(_PROOF_BYTES))


def _check_proof(secret: bytes, peer_rank: int, own_nonce: bytes, answer: bytes) -> None:
    if not hmac.compare_digest(answer, _proof(secret, peer_rank, own_nonce)):
        raise PeerRefused(f"rank {peer_rank} did not prove the pair's secret")


def _proof(secret: bytes, rank: int, nonce: bytes) -> bytes:
    """What `rank` answers to the other rank's nonce: only a holder of the pair's secret can compute it."""
    return hmac.new(secret, b"rank%d" % rank + nonce, hashlib.sha256).digest()
