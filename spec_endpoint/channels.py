"""Each tenant's tensor channel: offered through the ChannelHost, or attached in-process."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from specpool.common.errors import FieldError, StatusCode
from specpool.common.tensor_channel import ChannelBusy, ChannelError

if TYPE_CHECKING:
    from specpool.common.tensor_channel import ChannelHost, ChannelOffer, PairChannel

log = logging.getLogger(__name__)


class TenantChannels:
    def __init__(self, host: ChannelHost | None = None):
        self.host = host
        self._attached: dict[str, PairChannel] = {}
        self._lock = threading.Lock()

    def offer(self, tenant: str) -> ChannelOffer:
        """A fresh pair for the tenant (its previous channel, if any, is dropped)."""
        if self.host is None:
            raise FieldError("tenant", "this endpoint has no tensor channel host", StatusCode.FAILED_PRECONDITION)
        with self._lock:
            self._attached.pop(tenant, None)
        try:
            return self.host.offer(tenant)
        except ChannelBusy as e:
            raise FieldError("tenant", str(e), StatusCode.RESOURCE_EXHAUSTED) from e
        except ChannelError as e:  # closed: the endpoint is stopping
            raise FieldError("tenant", str(e), StatusCode.UNAVAILABLE) from e

    def attach(self, tenant: str, channel: PairChannel) -> None:
        """Use an already connected channel (in-process: one end of a LoopbackChannel pair)."""
        with self._lock:
            self._attached[tenant] = channel

    def get(self, tenant: str) -> PairChannel | None:
        """The tenant's connected channel, or None (never offered, or its peer has not joined yet)."""
        with self._lock:
            channel = self._attached.get(tenant)
        if channel is None and self.host is not None:
            channel = self.host.get(tenant)
        return channel

    def drop(self, tenant: str) -> None:
        """Forget a broken channel: the tenant's next dense round asks it to open another."""
        with self._lock:
            channel = self._attached.pop(tenant, None)
        if channel is not None:
            try:
                channel.close()
            except ChannelError as e:
                log.debug("closing tenant %s's channel: %s", tenant, e)
        if self.host is not None:
            self.host.drop(tenant)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
