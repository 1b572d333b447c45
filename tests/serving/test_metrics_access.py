"""/metrics names every tenant, so it answers only to the metrics token by default (issue 52): a real
serve-router started without $SPECPOOL_METRICS_TOKEN refuses /metrics with 401 and a body saying what to
set, and logs so at start; with --metrics-open it serves whoever reaches the port (the in-cluster scrape
behind a NetworkPolicy); with a token it serves that token alone. The probes stay open throughout."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from specpool.cluster.processes import ServerProcess, start_server
from specpool.cluster.redis_server import start_redis
from specpool.common.metrics_http import METRICS_TOKEN_ENV


def _get(server: ServerProcess, path: str, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{server.metrics_port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow  # Redis and three router processes
def test_metrics_wants_the_token_unless_opened_explicitly():
    redis = start_redis()
    servers: dict[str, ServerProcess] = {}
    try:
        router = ["serve-router", "--port", "0", "--metrics-port", "0", "--http-port", "-1", "--redis", redis.url]
        servers["closed"] = start_server("router-closed", router, env={METRICS_TOKEN_ENV: ""})
        servers["open"] = start_server("router-open", [*router, "--metrics-open"], env={METRICS_TOKEN_ENV: ""})
        servers["token"] = start_server("router-token", router, env={METRICS_TOKEN_ENV: "operators-metrics-1"})

        code, body = _get(servers["closed"], "/metrics")
        message = json.loads(body)["error"]
        assert code == 401 and METRICS_TOKEN_ENV in message and "--metrics-open" in message, (code, body)
        assert _get(servers["closed"], "/metrics", "anything")[0] == 401
        assert "refuses every scrape" in servers["closed"].logs()

        code, body = _get(servers["open"], "/metrics")
        assert code == 200 and b"specpool_router_" in body, body[:200]
        assert "--metrics-open" in servers["open"].logs() and "open to whoever reaches the port" in \
            servers["open"].logs()

        assert _get(servers["token"], "/metrics")[0] == 401
        assert _get(servers["token"], "/metrics", "operators-metrics-2")[0] == 401
        code, body = _get(servers["token"], "/metrics", "operators-metrics-1")
        assert code == 200 and b"specpool_router_" in body
        assert "requires the metrics token" in servers["token"].logs()

        for server in servers.values():  # kubelets' probes need no token
            assert _get(server, "/readyz") == (200, b"ok")
        for name in ("closed", "open"):  # without a token /capacity answers as before: no tenant's figures
            assert _get(servers[name], "/capacity")[0] == 200
    finally:
        for server in servers.values():
            server.stop()
        redis.close()
