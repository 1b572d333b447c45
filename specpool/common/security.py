# Over 400 lines: one trust model; the CA (LocalCA) and a process's credentials (Security) build each other.
"""Who may call what: TLS on every gRPC hop, identities from certificates and bearer tokens.

Every server speaks TLS. Services (router, target, endpoint), operators' tools and tenants' programs
hold a certificate from the cluster's CA that names them: URI SAN spiffe://specpool/<role>/<name>, DNS
SANs <role>.specpool and <name>.<role>.specpool. A caller checks the server's certificate against the
name it expects (a router dials a registered target as <tenant>.target.specpool, so a member that only
wrote a heartbeat into Redis gets nothing). Targets and endpoints require a client certificate (mutual
TLS); the router, whose callers are tenants' programs, asks for none and takes a bearer token that the
tokens file maps to a tenant.

The role says whose per-tenant figures a caller reads (Identity.tenant_scope): an `operator`
certificate (operators' tools) and the services that run the pool every tenant's; a tenant's `client`
certificate (client/<tenant>), a target's and a bearer token's tenant their own tenant's alone. Over
HTTP (/capacity, /metrics) the operators' credential is the metrics token.

The caller's identity comes from that credential, never from a header or a request field. One
exception is delegation: a target takes the tenant a *router* names in x-specpool-tenant, because the
router authenticated that tenant's token.

A TLS directory holds the cert-manager Secret layout: ca.crt, tls.crt, tls.key. A directory that also
holds ca.key is a throwaway local CA (`specpool up`, the tests): each process issues itself a
certificate from it at start, and it holds tokens.yaml. Production hands each process only its own
certificate and key.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from specpool.common import errors, outcomes

log = logging.getLogger(__name__)

TLS_DIR_ENV = "SPECPOOL_TLS_DIR"
TOKENS_FILE_ENV = "SPECPOOL_TOKENS_FILE"
CA_CERT, CERT, KEY, CA_KEY, TOKENS = "ca.crt", "tls.crt", "tls.key", "ca.key", "tokens.yaml"
TENANT_HEADER = "x-specpool-tenant"  # honoured only from a router (see module docstring)
ROLES = ("router", "target", "endpoint", "client", "operator")
# Who reads every tenant's per-tenant figures: the services that run the pool, operators' tools, and
# anyone on an --insecure server (where nobody is authenticated, any caller can be any tenant anyway).
SEES_EVERY_TENANT = frozenset({"router", "endpoint", "operator", "anonymous"})
SPIFFE_PREFIX = "spiffe://specpool/"
INSECURE_WARNING = ("--insecure: no TLS and no authentication; any process that reaches this port can "
                    "act as any tenant. Use it only on a network nobody else can reach")


class SecurityError(RuntimeError):
    """Credentials are missing or unusable; the message says which file or flag."""


@dataclass(frozen=True)
class Identity:
    """Who a call comes from. role: router, target, endpoint, operator or client (certificates; a client
    is a tenant's program, named after its tenant), tenant (a bearer token), or anonymous (an
    --insecure server: nobody is authenticated)."""

    role: str
    name: str

    @property
    def anonymous(self) -> bool:
        return self.role == "anonymous"

    @property
    def tenant_scope(self) -> str | None:
        """Whose per-tenant figures (sessions, token counts, leases) this caller may read: None for
        every tenant's, else its own tenant's alone (a client, a target and a token all name one)."""
        return None if self.role in SEES_EVERY_TENANT else self.name


ANONYMOUS = Identity("anonymous", "")


def server_name(role: str, name: str | None = None) -> str:
    """The DNS SAN a caller checks: <role>.specpool (any member of the role) or <name>.<role>.specpool."""
    return f"{name}.{role}.specpool" if name else f"{role}.specpool"


# -- certificates ----------------------------------------------------------------------------------


class LocalCA:
    """A throwaway certificate authority in a directory (0700): ca.crt, ca.key, tokens.yaml."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.cert_pem = (self.dir / CA_CERT).read_bytes()
        self._cert = x509.load_pem_x509_certificate(self.cert_pem)
        self._key = serialization.load_pem_private_key((self.dir / CA_KEY).read_bytes(), password=None)
        self._lock = threading.Lock()

    @classmethod
    def create(cls, directory: Path, days: int = 30) -> LocalCA:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specpool local CA")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write_private(directory / CA_KEY, _key_pem(key))
        (directory / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(directory / TOKENS, b"# tenant: bearer token (the router maps a caller's token to its tenant)\n")
        return cls(directory)

    @classmethod
    def temporary(cls) -> LocalCA:
        """A fresh CA in a temporary directory, removed when this process exits."""
        root = Path(tempfile.mkdtemp(prefix="specpool-ca-"))
        atexit.register(shutil.rmtree, root, True)
        return cls.create(root / "ca")

    @property
    def env(self) -> dict[str, str]:
        """What a server started from here needs in its environment to issue itself a certificate."""
        return {TLS_DIR_ENV: str(self.dir)}

    def client(self, name: str, tenant: str | None = None) -> Security:
        """A tenant's program holding a certificate client/<name> and, given a tenant, that tenant's
        token. It reads only tenant <name>'s figures: operators' tools take `operator()`."""
        return Security.load(self.dir, "client", name, token=self.token(tenant) if tenant else None)

    def operator(self, name: str = "ops") -> Security:
        """An operator's tool holding a certificate operator/<name>: it reads every tenant's figures."""
        return Security.load(self.dir, "operator", name)

    def issue(self, role: str, name: str, days: int = 30) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) naming role/name, for server and client use."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans = [x509.UniformResourceIdentifier(f"{SPIFFE_PREFIX}{role}/{name}"),
                x509.DNSName(server_name(role)), x509.DNSName(server_name(role, name))]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{role}/{name}")]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                      x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def write_identity(self, directory: Path, role: str, name: str) -> Path:
        """A TLS directory (ca.crt, tls.crt, tls.key) holding only this identity: what production gives."""
        cert, key = self.issue(role, name)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CA_CERT).write_bytes(self.cert_pem)
        (directory / CERT).write_bytes(cert)
        _write_private(directory / KEY, key)
        return directory

    def token(self, tenant: str) -> str:
        """The tenant's bearer token in tokens.yaml, added (a fresh random one) if it has none."""
        with self._lock:
            table = _read_yaml(self.dir / TOKENS)
            if tenant not in table:
                table[tenant] = secrets.token_urlsafe(24)
                _write_private(self.dir / TOKENS, yaml.safe_dump(table).encode())
            value = table[tenant]
        return value[0] if isinstance(value, list) else value


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_yaml(path: Path) -> dict:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SecurityError(f"{path}: expected a mapping of tenant to token(s)")
    return data


@functools.lru_cache(maxsize=1024)
def identity_of_certificate(pem: bytes) -> Identity | None:
    """The role/name a (CA-verified) certificate names: its URI SAN spiffe://specpool/<role>/<name>,
    else a DNS SAN <name>.<role>.specpool (what Helm's genSignedCert can write); None if neither."""
    try:
        san = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        role, _, name = uri.removeprefix(SPIFFE_PREFIX).partition("/")
        if uri.startswith(SPIFFE_PREFIX) and role in ROLES and name:
            return Identity(role, name)
    for dns in san.get_values_for_type(x509.DNSName):
        labels = dns.split(".")
        if len(labels) == 3 and labels[2] == "specpool" and labels[1] in ROLES and labels[0]:
            return Identity(labels[1], labels[0])
    return None


# -- tokens ----------------------------------------------------------------------------------------


class TokenTable:
    """tenant -> bearer token(s) from a YAML file, re-read when the file changes (a rotated Secret)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._mtime: tuple[int, int, int] | None = None
        self._by_digest: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self._load()

    def tenant_of(self, token: str) -> str | None:
        self._load()
        digest = hashlib.sha256(token.encode()).digest()
        with self._lock:
            # A dict lookup of the digest: the comparison never runs over the secret itself.
            return self._by_digest.get(digest)

    def _load(self) -> None:
        try:
            stat = self.path.stat()
            mtime = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        except OSError as e:
            raise SecurityError(f"tokens file {self.path}: {e}") from e
        if mtime == self._mtime:
            return
        table = {}
        for tenant, tokens in _read_yaml(self.path).items():
            for token in tokens if isinstance(tokens, list) else [tokens]:
                if not isinstance(token, str) or len(token) < 16:
                    raise SecurityError(f"{self.path}: tenant {tenant!r}: tokens must be strings of 16+ characters")
                table[hashlib.sha256(token.encode()).digest()] = str(tenant)
        with self._lock:
            self._by_digest, self._mtime = table, mtime


def _bearer(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


# -- one process's credentials ---------------------------------------------------------------------


class Security:
    """This process's TLS material and checks; `Security.insecure()` for a plaintext, open process."""

    def __init__(self, *, ca: bytes | None, cert: bytes | None, key: bytes | None,
                 identity: Identity, tokens: TokenTable | None = None, token: str | None = None):
        self.ca, self.cert, self.key = ca, cert, key
        self.identity = identity
        self.tokens = tokens
        self.token = token  # sent as a bearer token on this process's calls (a tenant's client; never a server's)

    @property
    def enabled(self) -> bool:
        return self.ca is not None

    @classmethod
    def insecure(cls) -> Security:
        return cls(ca=None, cert=None, key=None, identity=ANONYMOUS)

    @classmethod
    def load(cls, tls_dir: str | Path | None, role: str, name: str, *, insecure: bool = False,
             tokens_file: str | Path | None = None, token: str | None = None) -> Security:
        """From a TLS directory (flag, else $SPECPOOL_TLS_DIR). A directory with ca.key is a local CA:
        a certificate for role/name is issued on the spot. Raises SecurityError saying what is missing."""
        if insecure:
            log.warning("%s", INSECURE_WARNING)
            return cls.insecure()
        tls_dir = tls_dir or os.environ.get(TLS_DIR_ENV)
        if not tls_dir:
            raise SecurityError(f"no TLS credentials: pass --tls-dir DIR (or set {TLS_DIR_ENV}) holding "
                                f"{CA_CERT}, {CERT} and {KEY}; --insecure runs without TLS and authentication")
        directory = Path(tls_dir)
        try:
            if (directory / CA_KEY).exists():
                ca = LocalCA(directory)
                cert, key = ca.issue(role, name)
                ca_pem = ca.cert_pem
            else:
                ca_pem, cert, key = ((directory / f).read_bytes() for f in (CA_CERT, CERT, KEY))
        except OSError as e:
            raise SecurityError(f"TLS directory {directory}: {e}") from e
        identity = identity_of_certificate(cert)
        if identity is None:
            raise SecurityError(f"{directory / CERT} names no specpool identity: a URI SAN "
                                f"{SPIFFE_PREFIX}<role>/<name> or a DNS SAN <name>.<role>.specpool, role one of {ROLES}")
        tokens_file = tokens_file or os.environ.get(TOKENS_FILE_ENV)
        if not tokens_file and (directory / TOKENS).exists():
            tokens_file = directory / TOKENS
        tokens = TokenTable(Path(tokens_file)) if tokens_file else None
        return cls(ca=ca_pem, cert=cert, key=key, identity=identity, tokens=tokens, token=token)

    # -- server side --

    def add_port(self, server: grpc.Server, address: str, *, client_certificates: bool) -> int:
        """Binds address; with TLS, client_certificates=True also requires a CA-signed client
        certificate at the handshake (mutual TLS)."""
        if not self.enabled:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                                  require_client_auth=client_certificates)
        return server.add_secure_port(address, credentials)

    def caller(self, context: grpc.ServicerContext) -> Identity | None:
        """The authenticated caller: the client certificate's identity (the mutual-TLS ports), else a
        bearer token's tenant (the router's port); None when the call proves nobody, or presents a
        token nobody issued. ANONYMOUS when insecure. A token never outranks a certificate: a
        service is who its certificate says, whatever token it carries."""
        if not self.enabled:
            return ANONYMOUS
        pems = context.auth_context().get("x509_pem_cert") or []
        if pems:
            return identity_of_certificate(pems[0])
        token = _bearer(context.invocation_metadata() or ())
        tenant = self.tokens.tenant_of(token) if token and self.tokens is not None else None
        return Identity("tenant", tenant) if tenant else None

    def interceptor(self, on_refused: Callable[[str, str], None] | None = None) -> grpc.ServerInterceptor:
        """Authenticates every call; `on_refused(method, "unauthenticated")` hears each refusal."""
        return _Authenticate(self, on_refused)

    # -- client side --

    def channel(self, address: str, role: str, name: str | None = None,
                options: list[tuple[str, object]] | None = None) -> grpc.Channel:
        """A channel to a server that must prove it is `role` (and `name`, when given) with a certificate
        from this process's CA; carries this process's certificate, and its token when it has one."""
        options = list(options or [])
        if not self.enabled:
            return grpc.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                                   certificate_chain=self.cert)
        if self.token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.token))
        options.append(("grpc.ssl_target_name_override", server_name(role, name)))
        return grpc.secure_channel(address, credentials, options=options)


class _Authenticate(grpc.ServerInterceptor):
    """UNAUTHENTICATED for a call that proves no identity, before the servicer sees it."""

    def __init__(self, security: Security, on_refused: Callable[[str, str], None] | None = None):
        self.security = security
        self.on_refused = on_refused

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not self.security.enabled:
            return handler

        def check(context) -> None:
            if self.security.caller(context) is None:
                if self.on_refused is not None:
                    self.on_refused(handler_call_details.method, outcomes.UNAUTHENTICATED)
                errors.abort(context, grpc.StatusCode.UNAUTHENTICATED, "authorization",
                             "send a bearer token the router's tokens file lists (metadata 'authorization: "
                             "Bearer <token>') or a client certificate from this cluster's CA")

        def wrap(behavior, streaming_response: bool):
            if streaming_response:
                def checked_stream(request, context):
                    check(context)
                    yield from behavior(request, context)
                return checked_stream

            def checked(request, context):
                check(context)
                return behavior(request, context)
            return checked

        for kind, streaming in (("unary_unary", False), ("stream_unary", False),
                                ("unary_stream", True), ("stream_stream", True)):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: wrap(behavior, streaming)})
        return handler


def check_metrics_token(header: str | None, expected: str | None) -> bool:
    """An HTTP Authorization header against the operator's metrics token (None: no token required)."""
    if not expected:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected.encode())

