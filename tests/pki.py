"""The tests' throwaway CA: every server a test starts issues itself a certificate from it.

conftest.py puts its directory in SPECPOOL_TLS_DIR, which every started process inherits, so the
servers under test run with TLS, mutual TLS and tokens exactly as `specpool up` runs them. Tests
reach them with `channel()`.
"""

from __future__ import annotations

import grpc

from specpool.common.security import LocalCA

CA = LocalCA.temporary()


def channel(address: str, role: str, name: str | None = None, tenant: str = "tester", options=None) -> grpc.Channel:
    """A channel to a `role` server (named `name`, when given) as client/<tenant>, with that tenant's
    bearer token (routers map it to the tenant; targets and endpoints go by the certificate)."""
    return CA.client(tenant, tenant).channel(address, role, name, options=options)


def token_metadata(tenant: str) -> list[tuple[str, str]]:
    """Call metadata that makes a router call the tenant's own."""
    return [("authorization", f"Bearer {CA.token(tenant)}")]
