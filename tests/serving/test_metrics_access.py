"""/metrics names every tenant, so it answers only to the metrics token by default (issue 52): a real
serve-router started without $SPECPOOL_METRICS_TOKEN refuses /metrics with 401 and a body saying what to
set, and logs so at start; with --metrics-open it serves whoever reaches the port (the in-cluster scrape
behind a NetworkPolicy); with a token it serves that token alone. The probes stay open throughout."""

from __future__ import annotations

import json

import pytest

from specpool.cluster.processes import ServerProcess, start_server
from specpool.cluster.redis_server import start_redis
from specpool.common.metrics_http import METRICS_TOKEN_ENV
from tests.cluster.test_figure_visibility import http_get


@pytest.mark.slow  # Redis and three router processes
def test_metrics_wants_the_token_unless_opened_explicitly():
    redis = start_redis()
    servers: dict[str, ServerProcess] = {}
    try:
        router = ["serve-router", "--port", "0", "--metrics-port", "0", "--http-port", "-1", "--redis", redis.url]
        servers["closed"] = start_server("router-closed", router, env={METRICS_TOKEN_ENV: ""})
        servers["open"] = start_server("router-open", [*router, "--metrics-open"], env={METRICS_TOKEN_ENV: ""})
        servers["token"] = start_server("router-token", router, env={METRICS_TOKEN_ENV: "operators-metrics-1"})

        code, body = http_get(servers["closed"], "/metrics", None)
        message = json.loads(body)["error"]
        assert code == 401 and METRICS_TOKEN_ENV in message and "--metrics-open" in message, (code, body)
        assert http_get(servers["closed"], "/metrics", "anything")[0] == 401
        assert "refuses every scrape" in servers["closed"].logs()

        code, body = http_get(servers["open"], "/metrics", None)
        assert code == 200 and b"specpool_router_" in body, body[:200]
        assert "--metrics-open" in servers["open"].logs() and "open to whoever reaches the port" in \
            servers["open"].logs()

        assert http_get(servers["token"], "/metrics", None)[0] == 401
        assert http_get(servers["token"], "/metrics", "operators-metrics-2")[0] == 401
        code, body = http_get(servers["token"], "/metrics", "operators-metrics-1")
        assert code == 200 and b"specpool_router_" in body
        assert "requires the metrics token" in servers["token"].logs()

        for server in servers.values():  # kubelets' probes need no token
            assert http_get(server, "/readyz", None) == (200, b"ok")
        for name in ("closed", "open"):  # without a token /capacity answers as before: no tenant's figures
            assert http_get(servers[name], "/capacity", None)[0] == 200
    finally:
        for server in servers.values():
            server.stop()
        redis.close()
