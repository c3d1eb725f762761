"""Mutual TLS inside the mesh, TLS at the router's public edge, and the one place channels open.

Inside the mesh every service has an identity: the mesh CA and its own certificate and key
(`MeshIdentity`). A service's gRPC server asks every peer for a certificate signed by the mesh CA
and refuses one without; a service's channels present its certificate and check that the peer's
was signed by the CA for the address it dialled (so a rogue process that registered its
address in Redis, without a certificate from the CA, fails the handshake and gets nothing).

`MeshCertificates` makes the CA and per-service certificates with `cryptography` (what
`kvmesh up --tls` and `kvmesh certs` do); an operator can bring their own (cert-manager, say)
and pass the files with `--mesh-ca`, `--mesh-cert`, `--mesh-key`.

The router's public ports are set apart: plaintext unless the router is given a server
certificate (`--tls-cert`/`--tls-key`), and then TLS without client certificates (callers
authenticate with API keys).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("kvmesh.tls")

# Service kinds that get a certificate of their own; `client` is for operator tools (kvmesh
# health, kvmesh up's readiness checks), which must present one too.
MESH_NAMES = ("kvcache", "scheduler", "worker", "router", "client")


@dataclass(frozen=True)
class MeshIdentity:
    """One service's mTLS identity: the mesh CA and this service's certificate chain and key (PEM)."""

    ca: bytes
    cert: bytes
    key: bytes
    # The name a peer's certificate must carry; empty: the host of the address dialled. One shared
    # name suits addresses nobody can know ahead (pod IPs, the hostnames of scaled containers).
    server_name: str = ""

    @classmethod
    def from_files(cls, ca: str, cert: str, key: str, server_name: str = "") -> "MeshIdentity":
        return cls(Path(ca).read_bytes(), Path(cert).read_bytes(), Path(key).read_bytes(), server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: presents our certificate and refuses a peer without one from the CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: presents our certificate and accepts only a server with one from the CA."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)


def mesh_identity(common) -> MeshIdentity | None:
    """The identity named by a CommonConfig (`mesh_ca`, `mesh_cert`, `mesh_key`); None when TLS is off."""
    if not common.mesh_ca:
        return None
    return MeshIdentity.from_files(common.mesh_ca, common.mesh_cert, common.mesh_key, common.mesh_server_name)


def mesh_server_credentials(common) -> grpc.ServerCredentials | None:
    """What an internal service's gRPC server listens with: mTLS when the mesh has TLS on, else None (plaintext)."""
    identity = mesh_identity(common)
    return identity.server_credentials() if identity else None


def check_files(names_and_paths: dict[str, str]) -> None:
    """All given or none, and every given file exists: ValueError naming the setting otherwise."""
    given = {name: path for name, path in names_and_paths.items() if path}
    if given and len(given) != len(names_and_paths):
        missing = [name for name in names_and_paths if name not in given]
        raise ValueError(f"{', '.join(missing)} must be set together with {', '.join(given)}")
    for name, path in given.items():
        if not os.path.isfile(path):
            raise ValueError(f"{name}: no such file {path!r}")


def channel(address: str, credentials: grpc.ChannelCredentials | None = None, *, aio: bool = True,
            options: tuple = ()):
    """A channel to `address`: TLS with `credentials` (mesh or public), plaintext without.
    Every channel kvmesh opens goes through here."""
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(address, options=list(options))
    return module.secure_channel(address, credentials, options=list(options))


def mesh_channel(address: str, identity: MeshIdentity | None, *, aio: bool = True, options: tuple = ()):
    """A channel to another service of the mesh: mTLS when the mesh has an identity."""
    if identity is None:
        return channel(address, aio=aio, options=options)
    if identity.server_name:
        options = (*options, ("grpc.ssl_target_name_override", identity.server_name))
    return channel(address, identity.channel_credentials(), aio=aio, options=options)


class RegisteredPeers:
    """Channels to the addresses other services registered in Redis, each believed only once the
    peer has answered over it: with mTLS, once the peer proved a certificate from the mesh CA for
    that address. A registry entry anyone could write (a rogue plaintext server) therefore gets no
    traffic. An address that does not answer is skipped, logged once, and tried again after `retry_s`."""

    FAILED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # no handshake, or no answer

    def __init__(self, identity: MeshIdentity | None, kind: str, retry_s: float = 5.0, probe_timeout_s: float = 2.0):
        self.identity, self.kind = identity, kind
        self.retry_s, self.probe_timeout_s = retry_s, probe_timeout_s
        self._verified: dict[str, grpc.aio.Channel] = {}
        self._failed_at: dict[str, float] = {}  # address -> when it last failed (time.monotonic)

    async def channels(self, addresses: list[str]) -> list[tuple[str, grpc.aio.Channel]]:
        """(address, channel) for the verified ones among `addresses`, in their order; new ones are probed
        (concurrently) first. Channels stay open for as long as this object lives: calls may be in flight."""
        now = time.monotonic()
        due = [a for a in dict.fromkeys(addresses)
               if a not in self._verified and now - self._failed_at.get(a, -self.retry_s) >= self.retry_s]
        await asyncio.gather(*(self._probe(a) for a in due))
        return [(a, self._verified[a]) for a in addresses if a in self._verified]

    async def _probe(self, address: str) -> None:
        ch = mesh_channel(address, self.identity)
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in self.FAILED:
                await ch.close()
                if address not in self._failed_at:
                    log.warning("skipping the %s registered at %s: %s: %s", self.kind, address, e.code().name, e.details())
                self._failed_at[address] = time.monotonic()
                return
        self._failed_at.pop(address, None)
        self._verified[address] = ch


def public_server_credentials(cert: str, key: str) -> grpc.ServerCredentials | None:
    """The router's public gRPC port: TLS with this certificate, no client certificate asked; None: plaintext."""
    if not cert:
        return None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


def public_ssl_context(cert: str, key: str) -> ssl.SSLContext | None:
    """The router's HTTP port: the same certificate as its public gRPC port; None: plaintext."""
    if not cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def public_client_credentials(ca_file: str | None) -> grpc.ChannelCredentials:
    """A client of the router's TLS port: trusts `ca_file`, or gRPC's bundled roots when None."""
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes() if ca_file else None)


def default_names() -> list[str]:
    """Names every local certificate carries: loopback and this host's name."""
    return sorted({"localhost", "127.0.0.1", "::1", socket.gethostname()})


# ---- making certificates ----------------------------------------------------------------------


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvmesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _subject_alt_names(names: list[str]):
    from cryptography import x509

    entries = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def make_ca(common_name: str = "kvmesh mesh CA", days: int = 3650) -> tuple[bytes, bytes]:
    """A new CA: (certificate PEM, key PEM). It signs service certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue_certificate(ca_cert: bytes, ca_key: bytes, common_name: str, names: list[str],
                      days: int = 365) -> tuple[bytes, bytes]:
    """A certificate signed by the CA for `common_name`, valid for the addresses `names` (DNS
    names or IPs, as subject alternative names) as a server and as a client: (cert PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if not names:
        raise ValueError("a certificate needs at least one name")
    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(_subject_alt_names(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)
            .sign(signer, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def certificate_names(cert_pem: bytes) -> list[str]:
    """The subject alternative names (DNS names and IPs, as text) of the first certificate in `cert_pem`."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(v) for v in sans.get_values_for_type(x509.DNSName) + sans.get_values_for_type(x509.IPAddress)]


def _write(path: Path, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass(frozen=True)
class MeshCertificates:
    """A folder holding the mesh CA (`ca.pem`, `ca-key.pem`) and one certificate per service kind
    (`NAME.pem`, `NAME-key.pem` for each of MESH_NAMES). Keys are written mode 0600."""

    folder: Path

    @classmethod
    def create(cls, folder: str | Path, names: list[str] | None = None) -> "MeshCertificates":
        """Makes the CA and the certificates, valid for `names` plus loopback and this host's name;
        reuses a CA already in the folder, so that certificates issued before stay valid."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        certs = cls(folder)
        if not certs.ca_path.exists():
            ca_cert, ca_key = make_ca()
            _write(folder / "ca-key.pem", ca_key, private=True)
            _write(certs.ca_path, ca_cert)
        ca_cert, ca_key = certs.ca_path.read_bytes(), (folder / "ca-key.pem").read_bytes()
        all_names = sorted(set(default_names()) | set(names or ()))
        for service in MESH_NAMES:
            cert, key = issue_certificate(ca_cert, ca_key, f"kvmesh-{service}", all_names)
            _write(certs.key_path(service), key, private=True)
            _write(certs.cert_path(service), cert)
        return certs

    @property
    def ca_path(self) -> Path:
        return self.folder / "ca.pem"

    def cert_path(self, service: str) -> Path:
        return self.folder / f"{service}.pem"

    def key_path(self, service: str) -> Path:
        return self.folder / f"{service}-key.pem"

    def flags(self, service: str) -> list[str]:
        """The `kvmesh serve SERVICE` flags that give it its identity."""
        return ["--mesh-ca", str(self.ca_path), "--mesh-cert", str(self.cert_path(service)),
                "--mesh-key", str(self.key_path(service))]

    def identity(self, service: str) -> MeshIdentity:
        return MeshIdentity.from_files(str(self.ca_path), str(self.cert_path(service)), str(self.key_path(service)))
