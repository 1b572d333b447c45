import dataclasses
import multiprocessing
import threading
import time

import pytest
import torch

from engine.tensor_channel import (
    ChannelBusy,
    ChannelError,
    ChannelHost,
    ChannelOffer,
    DistributedPairChannel,
    LoopbackChannel,
    PairChannel,
)

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


def test_gloo_pair_in_one_process_orders_sends_and_breaks_cleanly():
    host = ChannelHost(timeout_s=10.0, device=CPU)
    try:
        offer = host.offer("target-a")
        assert (offer.backend, offer.target_rank, offer.host) == ("gloo", 1, "127.0.0.1")
        assert offer.prefix.startswith("pair/target-a/")
        peer = DistributedPairChannel.connect(offer, offer.target_rank, device=CPU)
        channel = host.get("target-a", timeout_s=10.0)
        assert isinstance(channel, DistributedPairChannel)
        echo = threading.Thread(target=_echo, args=(peer,))
        echo.start()
        _check_echoes(channel, seed=1)
        echo.join(timeout=5)

        peer.close()
        with pytest.raises(ChannelError, match="recv"):
            channel.recv((3,), torch.float32)
        channel.send(torch.ones(3))  # accepted at once; fails on the sender thread
        deadline = time.monotonic() + 5
        with pytest.raises(ChannelError, match="send failed"):
            while time.monotonic() < deadline:
                channel.send(torch.ones(3))
                time.sleep(0.05)
    finally:
        host.close()


def test_connect_times_out_with_a_clear_error_when_no_peer_joins():
    host = ChannelHost(timeout_s=1.0, device=CPU)
    try:
        offer = host.offer("target-b")
        nobody = dataclasses.replace(offer, prefix="pair/target-b/nobody-there")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="nobody-there"):
            DistributedPairChannel.connect(nobody, nobody.target_rank, device=CPU)
        assert time.monotonic() - t0 < 5
        assert host.get("target-b", timeout_s=3.0) is None  # rank 0 gave up too
        assert host.get("never-offered") is None
    finally:
        host.close()


def test_offers_nobody_joins_neither_hold_up_another_pair_nor_pile_up():
    """Rank 0 waited on the store's one connection: each offer nobody joined held every later one up
    for its whole timeout (fuzzed OpenTensorChannel calls: 50 offers, 25 minutes, a thread each)."""
    host = ChannelHost(timeout_s=3.0, device=CPU, max_joining=3)
    try:
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
        time.sleep(3.5)  # the ghosts' offers time out: room again
        host.offer("ghost-3")
    finally:
        host.close()


def test_connect_refuses_a_device_the_backend_cannot_carry():
    offer = ChannelOffer(host="127.0.0.1", port=1, prefix="p", backend="nccl", target_rank=1, timeout_s=1.0)
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
        channel = host.get(peer, timeout_s=20.0)
        assert channel is not None, "peer process never joined"
        _check_echoes(channel, seed)
        assert channel.recv((1,), torch.int64).item() == seed
    finally:
        process.join(timeout=20)
    assert process.exitcode == 0
    return channel


@pytest.mark.slow  # two peer processes
def test_gloo_pair_across_processes_and_re_offer_replaces_the_channel():
    host = ChannelHost(timeout_s=20.0, device=CPU)
    try:
        first = _run_peer(host, "target-c", seed=2)
        second = _run_peer(host, "target-c", seed=3)  # a restarted target gets a fresh pair
        assert second is not first
        with pytest.raises(ChannelError, match="closed"):
            first.send(torch.ones(1))
        host.drop("target-c")
        assert host.get("target-c") is None
    finally:
        host.close()
