import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from specpool.cluster.processes import wait_for
from specpool.common.tensor_channel import (
    ChannelBusy,
    ChannelError,
    ChannelHost,
    ChannelOffer,
    DistributedPairChannel,
    LoopbackChannel,
    PairChannel,
)
from tests.serving.test_listen_addresses import listening

CPU = torch.device("cpu")
# (shape, dtype): a dense draft-distribution-sized payload among small and integer ones
PAYLOADS = [
    ((3, 4, 1000), torch.float32),
    ((7,), torch.int64),
    ((2, 5), torch.float32),
    ((1, 1, 32000), torch.float32),
]


def _payloads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in PAYLOADS:
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g, dtype=dtype) * 1e3)
        else:
            out.append(torch.randint(-(2**62), 2**62, shape, generator=g, dtype=dtype))
    return out


def _echo(channel: PairChannel) -> None:
    """The peer's side of every exchange: receive each payload, send it back and a transformed copy."""
    for shape, dtype in PAYLOADS:
        x = channel.recv(shape, dtype)
        channel.send(x)
        channel.send(x * 2 + 1)


def _check_echoes(channel: PairChannel, seed: int) -> None:
    sent = _payloads(seed)
    for x in sent:  # all queued before anything is read back: send() must not wait for the peer
        channel.send(x)
    for x in sent:
        assert torch.equal(channel.recv(x.shape, x.dtype), x)  # bit-exact
        assert torch.equal(channel.recv(x.shape, x.dtype), x * 2 + 1)


def test_loopback_pair_round_trip_in_order():
    a, b = LoopbackChannel.pair()
    assert isinstance(a, PairChannel)
    peer = threading.Thread(target=_echo, args=(b,))
    peer.start()
    _check_echoes(a, seed=0)
    peer.join(timeout=5)


def test_loopback_snapshots_on_send_and_reports_close():
    a, b = LoopbackChannel.pair()
    x = torch.zeros(3)
    a.send(x)
    x += 1  # the caller reuses its buffer right away
    assert torch.equal(b.recv((3,), torch.float32), torch.zeros(3))
    a.send(torch.ones(2))
    a.close()
    with pytest.raises(ChannelError, match="expected"):
        b.recv((3,), torch.float32)
    with pytest.raises(ChannelError, match="peer closed"):
        b.recv((3,), torch.float32)
    with pytest.raises(ChannelError, match="closed"):
        a.send(x)


def _pair_and_echo(host: ChannelHost, offer: ChannelOffer, peer: str, seed: int) -> tuple[PairChannel, PairChannel]:
    """Joins the offer from this process and runs one echo exchange over the pair: (host's side, peer's side)."""
    peer_side = DistributedPairChannel.connect(offer, offer.target_rank, device=CPU)
    channel = host.get(peer, timeout_s=10.0)
    assert isinstance(channel, DistributedPairChannel)
    echo = threading.Thread(target=_echo, args=(peer_side,))
    echo.start()
    _check_echoes(channel, seed=seed)
    echo.join(timeout=5)
    return channel, peer_side


def test_gloo_pair_in_one_process_orders_sends_and_breaks_cleanly():
    with contextlib.closing(ChannelHost(timeout_s=10.0, device=CPU)) as host:
        offer = host.offer("target-a")
        assert (offer.backend, offer.target_rank, offer.host) == ("gloo", 1, "127.0.0.1")
        assert offer.prefix.startswith("pair/") and "target-a" not in offer.prefix
        assert len(offer.secret) == 32 and offer.secret.hex() not in repr(offer)
        channel, peer = _pair_and_echo(host, offer, "target-a", seed=1)

        peer.close()
        with pytest.raises(ChannelError, match="recv"):
            channel.recv((3,), torch.float32)
        channel.send(torch.ones(3))  # accepted at once; fails on the sender thread
        deadline = time.monotonic() + 5
        with pytest.raises(ChannelError, match="send failed"):
            while time.monotonic() < deadline:
                channel.send(torch.ones(3))
                time.sleep(0.05)


def test_connect_times_out_with_a_clear_error_when_no_peer_joins():
    with contextlib.closing(ChannelHost(timeout_s=1.0, device=CPU)) as host:
        offer = host.offer("target-b")
        nobody = dataclasses.replace(offer, prefix="pair/target-b/nobody-there")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="nobody-there"):
            DistributedPairChannel.connect(nobody, nobody.target_rank, device=CPU)
        assert time.monotonic() - t0 < 5
        assert host.get("target-b", timeout_s=3.0) is None  # rank 0 gave up too
        assert host.get("never-offered") is None


def test_offers_nobody_joins_neither_hold_up_another_pair_nor_pile_up():
    """Rank 0 waited on the store's one connection: each offer nobody joined held every later one up
    for its whole timeout (fuzzed OpenTensorChannel calls: 50 offers, 25 minutes, a thread each)."""
    with contextlib.closing(ChannelHost(timeout_s=3.0, device=CPU, max_joining=3)) as host:
        host.offer("ghost-1")
        host.offer("ghost-2")
        offer = host.offer("target-c")
        with pytest.raises(ChannelBusy, match="waiting for their peers"):
            host.offer("ghost-3")
        t0 = time.monotonic()
        peer = DistributedPairChannel.connect(offer, offer.target_rank, device=CPU)
        assert host.get("target-c", timeout_s=3.0) is not None
        assert time.monotonic() - t0 < 2.0, "paired only after the ghosts timed out"
        peer.close()

        def room_again() -> bool:  # once the ghosts' offers have timed out
            try:
                host.offer("ghost-3")
                return True
            except ChannelBusy:
                return False

        assert wait_for(room_again, timeout_s=10, interval_s=0.1)


def test_connect_refuses_a_device_the_backend_cannot_carry():
    offer = ChannelOffer(host="127.0.0.1", port=1, prefix="p", backend="nccl", target_rank=1, timeout_s=1.0,
                         secret=bytes(32))
    with pytest.raises(ValueError, match="nccl"):
        DistributedPairChannel.connect(offer, 1, device=CPU)


def _peer_process(offer: ChannelOffer, seed: int) -> None:
    channel = DistributedPairChannel.connect(offer, offer.target_rank, device=CPU)
    _echo(channel)
    channel.send(torch.tensor([seed]))
    channel.close()  # flushes the queued sends


def _run_peer(host: ChannelHost, peer: str, seed: int) -> PairChannel:
    offer = host.offer(peer)
    process = multiprocessing.get_context("spawn").Process(target=_peer_process, args=(offer, seed))
    process.start()
    try:
        # A spawned process imports torch first: 20 s was not always enough on a loaded 2-core machine.
        channel = host.get(peer, timeout_s=60.0)
        assert channel is not None, "peer process never joined"
        _check_echoes(channel, seed)
        assert channel.recv((1,), torch.int64).item() == seed
    finally:
        process.join(timeout=20)
    assert process.exitcode == 0
    return channel


@pytest.mark.slow  # two peer processes
def test_gloo_pair_across_processes_and_re_offer_replaces_the_channel():
    with contextlib.closing(ChannelHost(timeout_s=20.0, device=CPU)) as host:
        first = _run_peer(host, "target-c", seed=2)
        second = _run_peer(host, "target-c", seed=3)  # a restarted target gets a fresh pair
        assert second is not first
        with pytest.raises(ChannelError, match="closed"):
            first.send(torch.ones(1))
        host.drop("target-c")
        assert host.get("target-c") is None


# --- issue 14: who can reach the store must not be able to take a tenant's pair -----------------------------

# A process that reaches the store but holds no secret: it finds the waiting pair through the store alone
# (list_keys: the endpoint's rank 0 has registered under the pair's prefix) and joins it as rank 1 with the
# project's own client and a guessed secret. Prints "joined" if the endpoint took it as the peer.
_ATTACKER = r"""
import dataclasses, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from specpool.common.tensor_channel import ChannelOffer, DistributedPairChannel

host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
deadline = time.monotonic() + 10
while not (keys := [k for k in store.list_keys() if k.startswith("pair/")]) and time.monotonic() < deadline:
    time.sleep(0.05)
prefix = keys[0].rsplit("/", 2)[0]  # "<prefix>/0/<rank>": Gloo's rendezvous keys
fields = dict(host=host, port=port, prefix=prefix, backend="gloo", target_rank=1, timeout_s=5.0)
if "secret" in {f.name for f in dataclasses.fields(ChannelOffer)}:
    fields["secret"] = b"guessed" * 5
channel = DistributedPairChannel.connect(ChannelOffer(**fields), 1, device=torch.device("cpu"))
print("joined", flush=True)
channel.send(torch.ones(3))  # what a hijacker would feed the tenant's target... or read from the endpoint
channel.close()
"""


def _attack(host: ChannelHost) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", _ATTACKER, "127.0.0.1", str(host.port)], cwd=root, env=env,
                          check=False, capture_output=True, text=True, timeout=60)


def test_a_process_without_the_pairs_secret_is_refused_and_the_owner_still_pairs(caplog):
    # Rank 0 must still wait when the attacker joins: its interpreter takes seconds to start on a busy machine.
    with contextlib.closing(ChannelHost(timeout_s=30.0, device=CPU)) as host:
        host.offer("victim")
        with caplog.at_level(logging.WARNING, logger="specpool.common.tensor_channel"):
            attacker = _attack(host)
            taken = host.get("victim", timeout_s=10.0)
        assert taken is None, "the endpoint handed the tenant's channel to a process without the secret"
        assert "joined" not in attacker.stdout
        assert attacker.returncode != 0, attacker.stdout + attacker.stderr
        assert "(handshake" in attacker.stderr, attacker.stderr  # it was in the group, then refused
        assert any("did not prove the pair's secret" in r.getMessage() for r in caplog.records), caplog.text

        # The rightful target, with the secret from its (authenticated) call, pairs on a fresh offer.
        _, peer = _pair_and_echo(host, host.offer("victim"), "victim", seed=4)
        peer.close()


def test_a_peer_with_the_wrong_secret_is_refused_on_both_sides():
    with contextlib.closing(ChannelHost(timeout_s=5.0, device=CPU)) as host:
        offer = host.offer("target-d")
        wrong = dataclasses.replace(offer, secret=bytes(a ^ 1 for a in offer.secret))
        with pytest.raises((ChannelError, RuntimeError, TimeoutError)):
            DistributedPairChannel.connect(wrong, wrong.target_rank, device=CPU)
        assert host.get("target-d", timeout_s=5.0) is None
        with pytest.raises(ValueError, match="secret"):
            DistributedPairChannel.connect(dataclasses.replace(offer, secret=b""), 1, device=CPU)


def _listening_on(port: int) -> set[str]:
    """Addresses this process listens on at port."""
    return {address for address, p in listening(os.getpid()) if p == port}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_store_listens_on_the_given_host_and_port_only():
    port = _free_port()
    with contextlib.closing(ChannelHost(host="127.0.0.1", port=port, timeout_s=5.0, device=CPU)) as host:
        assert host.port == port
        assert _listening_on(port) == {"127.0.0.1"}  # torch alone bound every interface
    with contextlib.closing(ChannelHost(host="0.0.0.0", timeout_s=5.0, device=CPU)) as anywhere:  # every interface, on purpose
        assert _listening_on(anywhere.port) and _listening_on(anywhere.port) <= {"0.0.0.0", "::"}


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_store_listens_on_an_ipv6_host_and_pairs_there():
    with contextlib.closing(ChannelHost(host="::1", timeout_s=10.0, device=CPU)) as host:
        assert _listening_on(host.port) == {"::1"}
        offer = host.offer("target-v6")
        peer = DistributedPairChannel.connect(offer, offer.target_rank, device=CPU)
        channel = host.get("target-v6", timeout_s=10.0)
        assert channel is not None
        peer.send(torch.arange(5))
        assert torch.equal(channel.recv((5,), torch.int64), torch.arange(5))
        peer.close()


def test_the_store_names_no_peer_and_holds_no_secret():
    with contextlib.closing(ChannelHost(timeout_s=10.0, device=CPU)) as host:
        offers = [host.offer(peer) for peer in ("tenant-alpha", "tenant-beta")]
        for peer, offer in zip(("tenant-alpha", "tenant-beta"), offers):
            assert peer not in offer.prefix and offer.prefix.startswith("pair/")
        assert offers[0].secret != offers[1].secret and len(offers[0].secret) == 32
        peer = DistributedPairChannel.connect(offers[0], 1, device=CPU)
        assert host.get("tenant-alpha", timeout_s=10.0) is not None
        store = torch.distributed.TCPStore("127.0.0.1", host.port, is_master=False,
                                           timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
        keys = store.list_keys()
        assert keys
        for key in keys:
            assert "tenant" not in key, key
            value = store.get(key)
            assert not any(offer.secret in value or offer.secret.hex().encode() in value for offer in offers)
        peer.close()
