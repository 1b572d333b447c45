"""The chart and /metrics (issue 52): by default every server's /metrics wants the metrics token (a
generated one in each server's env, sent by the ServiceMonitor) and no prometheus.io annotation asks for
a scrape that could not send it; `metrics.open: true` passes --metrics-open to every server, makes no
token, and keeps the annotations."""

from __future__ import annotations

import pytest
import yaml

from specpool.common.metrics_http import METRICS_TOKEN_ENV
from tests.helm.test_rendered import CHART, helm, template  # noqa: F401 (helm: a fixture)

SERVERS = ("serve-router", "serve-target", "serve-spec")


def _render(helm_bin, *sets: str) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    result = template(helm_bin, "-f", str(CHART / "ci" / "default-values.yaml"), *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _servers(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """serve-* command -> (pod metadata, its container), one of each."""
    out = {}
    for d in docs:
        if d["kind"] == "Deployment":
            pod = d["spec"]["template"]
            container = pod["spec"]["containers"][0]
            command = next((a for a in container.get("args", []) if a in SERVERS), None)
            if command:
                out[command] = (pod["metadata"], container)
    return out


@pytest.mark.parametrize("sets, opened", [((), False), (("metrics.open=true",), True),
                                          (("metrics.open=true", "metrics.requireToken=true"), True)])
def test_metrics_want_the_token_unless_the_chart_opens_them(helm, sets, opened):  # noqa: F811
    docs = _render(helm, "serviceMonitor.enabled=true", *sets)
    servers = _servers(docs)
    assert set(servers) == set(SERVERS), sorted(servers)
    token = not opened or "metrics.requireToken=true" in sets
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert any(n.endswith("-metrics-token") for n in secrets) == token, secrets
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert ("authorization" in monitor["spec"]["endpoints"][0]) == token
    for command, (metadata, container) in servers.items():
        assert ("--metrics-open" in container["args"]) == opened, command
        assert (METRICS_TOKEN_ENV in {e["name"] for e in container["env"]}) == token, command
        annotations = metadata.get("annotations") or {}
        assert ("prometheus.io/scrape" in annotations) == (not token), (command, annotations)
