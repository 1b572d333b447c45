"""specpool/security.py and its use by every server: identities, tokens, the HTTP side door, and the
refusal to run open by accident."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import prometheus_client
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpool.common.metrics_http import MetricsHttpServer
from specpool.common.security import (
    Identity,
    LocalCA,
    Security,
    SecurityError,
    TokenTable,
    identity_of_certificate,
)
from specpool.common.serving import HealthState, add_health_and_reflection, build_server

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ca(tmp_path) -> LocalCA:
    return LocalCA.create(tmp_path / "ca")


def test_a_certificate_names_its_role_and_name_by_uri_or_by_dns(ca):
    cert, _ = ca.issue("target", "alpha")
    assert identity_of_certificate(cert) == Identity("target", "alpha")
    san = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"target.specpool", "alpha.target.specpool"}
    # What Helm's genSignedCert writes: DNS names only. A name outside the scheme names nobody.
    helm_like = _self_signed(["beta.endpoint.specpool", "endpoint.specpool"])
    assert identity_of_certificate(helm_like) == Identity("endpoint", "beta")
    assert identity_of_certificate(_self_signed(["example.com", "x.admin.specpool"])) is None


@pytest.mark.parametrize("identity, scope", [
    (Identity("operator", "ops"), None), (Identity("router", "r"), None), (Identity("endpoint", "spec"), None),
    (Identity("anonymous", ""), None),  # --insecure: nobody is authenticated, anyone may claim any tenant
    (Identity("client", "alpha"), "alpha"), (Identity("tenant", "alpha"), "alpha"), (Identity("target", "beta"), "beta"),
])
def test_whose_per_tenant_figures_each_role_reads(identity, scope):
    assert identity.tenant_scope == scope


def test_an_operator_certificate_names_the_operator_role(ca):
    assert ca.operator("ops").identity == Identity("operator", "ops")
    assert identity_of_certificate(_self_signed(["ops.operator.specpool"])) == Identity("operator", "ops")


def _self_signed(dns: list[str]) -> bytes:
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def test_tokens_map_to_tenants_and_a_rotated_file_is_read_again(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text("alpha: aaaaaaaaaaaaaaaaaaaa\nbeta: [bbbbbbbbbbbbbbbbbbbb, cccccccccccccccccccc]\n")
    table = TokenTable(path)
    assert table.tenant_of("aaaaaaaaaaaaaaaaaaaa") == "alpha"
    assert table.tenant_of("cccccccccccccccccccc") == "beta"
    assert table.tenant_of("aaaaaaaaaaaaaaaaaaab") is None
    path.write_text("alpha: dddddddddddddddddddd\n")  # rotated: the old token stops working
    assert table.tenant_of("aaaaaaaaaaaaaaaaaaaa") is None
    assert table.tenant_of("dddddddddddddddddddd") == "alpha"
    path.write_text("alpha: short\n")
    with pytest.raises(SecurityError, match="16"):
        table.tenant_of("dddddddddddddddddddd")


def test_a_tls_directory_without_a_ca_key_is_used_as_given(ca, tmp_path, monkeypatch):
    given = ca.write_identity(tmp_path / "target-tls", "target", "alpha")
    assert sorted(p.name for p in given.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert oct(os.stat(given / "tls.key").st_mode & 0o777) == "0o600"
    loaded = Security.load(given, "target", "ignored")  # the certificate decides who this process is
    assert loaded.identity == Identity("target", "alpha") and loaded.tokens is None
    monkeypatch.delenv("SPECPOOL_TLS_DIR")
    with pytest.raises(SecurityError, match="--tls-dir"):
        Security.load(None, "target", "alpha")


def test_without_credentials_a_server_refuses_to_start_and_says_what_to_pass(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPECPOOL_TLS_DIR"}
    env["SPECPOOL_REDIS_URL"] = "redis://127.0.0.1:1/0"
    proc = subprocess.run([sys.executable, "-m", "specpool.cli", "serve-router", "--port", "0", "--metrics-port", "0"],
                          check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--tls-dir" in proc.stderr and "--insecure" in proc.stderr


def test_insecure_is_a_choice_that_is_logged(caplog):
    with caplog.at_level("WARNING"):
        security = Security.load(None, "router", "r", insecure=True)
    assert not security.enabled
    assert any("--insecure" in r.message and "any tenant" in r.message for r in caplog.records)


def test_the_metrics_port_wants_the_token_when_one_is_set_and_the_probes_never_do():
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("specpool_test_things", "test", registry=registry).inc()
    health = HealthState()
    seen = []
    http = MetricsHttpServer(registry, 0, json_routes={"/capacity": lambda operator: seen.append(operator) or {}},
                             health=health, token="m" * 24)
    http.start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        assert _get(base + "/metrics")[0] == 401
        assert _get(base + "/capacity")[0] == 401
        assert _get(base + "/metrics", "Bearer " + "m" * 23 + "x")[0] == 401
        assert _get(base + "/metrics", "Bearer " + "m" * 24) == (200, True)
        assert _get(base + "/capacity", "Bearer " + "m" * 24)[0] == 200 and seen == [True]
        assert _get(base + "/livez")[0] == 200
        assert _get(base + "/readyz")[0] == 503  # live, not ready yet
        health.set_ready(True)
        assert _get(base + "/readyz")[0] == 200
    finally:
        http.stop()


def _get(url: str, authorization: str | None = None) -> tuple[int, bool]:
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, b"specpool_test_things_total" in r.read()
    except urllib.error.HTTPError as e:
        return e.code, False


def test_an_authenticated_server_refuses_before_the_servicer_runs(ca):
    """The interceptor ends an unauthenticated call: health and reflection included."""
    server_side = Security.load(ca.dir, "router", "r")
    server, port = build_server(0, credentials=server_side, client_certificates=False)
    add_health_and_reflection(server, []).set_ready(True)
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        check = lambda ch: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        anonymous = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.cert_pem),
                                        options=[("grpc.ssl_target_name_override", "router.specpool")])
        with pytest.raises(grpc.RpcError) as refused:
            check(anonymous)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in refused.value.details()
        assert check(ca.client("c", "alpha").channel(address, "router")).status == health_pb2.HealthCheckResponse.SERVING
        # A server that proves a name other than the one expected is refused by the client.
        with pytest.raises(grpc.RpcError) as wrong:
            check(ca.client("c", "alpha").channel(address, "target", "alpha"))
        assert wrong.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_local_ca_tokens_are_random_stable_and_private(ca):
    first = ca.token("alpha")
    assert len(first) >= 32 and ca.token("alpha") == first and ca.token("beta") != first
    assert oct(os.stat(ca.dir / "tokens.yaml").st_mode & 0o777) == "0o600"
    assert oct(os.stat(ca.dir / "ca.key").st_mode & 0o777) == "0o600"
    assert oct(os.stat(ca.dir).st_mode & 0o777) == "0o700"


def test_on_a_mutual_tls_port_the_certificate_decides_and_a_token_cannot_outrank_it(ca):
    """A target's certificate plus another tenant's token is still that target (found by review:
    the token used to win, so one tenant's token let a certificate holder act as that tenant)."""
    server_side = Security.load(ca.dir, "endpoint", "e")
    server, port = build_server(0, credentials=server_side)

    def who(request, context):
        caller = server_side.caller(context)
        return f"{caller.role}/{caller.name}".encode()

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Who", {"Call": grpc.unary_unary_rpc_method_handler(who)})])
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        target_a = Security.load(ca.dir, "target", "a", token=ca.token("b"))
        call = target_a.channel(address, "endpoint").unary_unary("/test.Who/Call")
        assert call(b"", timeout=5) == b"target/a"
    finally:
        server.stop(0)
