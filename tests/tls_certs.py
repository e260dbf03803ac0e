"""Throwaway TLS material for tests: a CA, a server certificate for 127.0.0.1/localhost and a
client certificate, all P-256 keys valid for one day, made with `cryptography` or the `openssl`
command line (whichever the caller asks for; `available_tools()` lists those present).
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertPaths:
    """PEM files of one test PKI."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def available_tools() -> list[str]:
    """"cryptography" and/or "openssl", whichever this machine has."""
    tools = []
    try:
        import cryptography  # noqa: F401

        tools.append("cryptography")
    except ImportError:
        pass
    if shutil.which("openssl"):
        tools.append("openssl")
    return tools


def make_certs(root: Path, tool: str) -> CertPaths:
    """Write a CA, a server and a client certificate with keys into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    paths = CertPaths(
        *(root / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key"))
    )
    if tool == "cryptography":
        _with_cryptography(paths)
    elif tool == "openssl":
        _with_openssl(root, paths)
    else:
        raise ValueError(f"tool must be 'cryptography' or 'openssl', got {tool!r}")
    return paths


def _with_cryptography(paths: CertPaths) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(subject: str, issuer: str, key) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def write_key(key, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder("moe-test-ca", "moe-test-ca", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    leaves = (
        (paths.server_cert, paths.server_key, "localhost", ExtendedKeyUsageOID.SERVER_AUTH),
        (paths.client_cert, paths.client_key, "moe-test-client", ExtendedKeyUsageOID.CLIENT_AUTH),
    )
    for cert_path, key_path, cn, usage in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        san = x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        )
        cert = (
            builder(cn, "moe-test-ca", key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(san, critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(aki, critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, key_path)


def _with_openssl(root: Path, paths: CertPaths) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=root, timeout=60)

    ec_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run(
        "req", "-x509", *ec_key, "-keyout", str(root / "ca.key"), "-out", str(paths.ca),
        "-days", "1", "-subj", "/CN=moe-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    leaves = (
        (paths.server_cert, paths.server_key, "localhost", "serverAuth"),
        (paths.client_cert, paths.client_key, "moe-test-client", "clientAuth"),
    )
    for cert_path, key_path, cn, usage in leaves:
        csr = root / f"{cn}.csr"
        ext = root / f"{cn}.ext"
        ext.write_text(
            "basicConstraints=CA:FALSE\n"
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
            f"extendedKeyUsage={usage}\n"
        )
        run(
            "req", "-new", *ec_key, "-keyout", str(key_path), "-out", str(csr),
            "-subj", f"/CN={cn}",
        )  # fmt: skip
        run(
            "x509", "-req", "-in", str(csr), "-CA", str(paths.ca), "-CAkey", str(root / "ca.key"),
            "-set_serial", str(int.from_bytes(cn.encode()[:8], "big")), "-days", "1",
            "-extfile", str(ext), "-out", str(cert_path),
        )  # fmt: skip
