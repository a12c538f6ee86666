"""Credentials for a Flower deployment: a CA, a SuperLink TLS certificate, SuperNode key pairs.

    python scripts/credentials.py DIR --superlink-address 10.0.0.1 --superlink-address superlink.lan \
        --supernodes 3

writes into DIR:

- ``ca.crt`` / ``ca.key``: a self-signed certificate authority (EC P-384). SuperNodes and the
  ``flwr`` CLI trust it (``--root-certificates ca.crt``; ``root-certificates`` in
  ``$FLWR_HOME/config.toml``).
- ``superlink.crt`` / ``superlink.key``: the SuperLink's server certificate, signed by the CA, with
  a subject alternative name for every ``--superlink-address`` (IP addresses and DNS names;
  ``127.0.0.1`` and ``localhost`` always). For ``flower-superlink --ssl-ca-certfile ca.crt
  --ssl-certfile superlink.crt --ssl-keyfile superlink.key``.
- ``supernode-<i>`` / ``supernode-<i>.pub``: one EC P-384 key pair per SuperNode in OpenSSH
  format, as Flower's SuperNode authentication wants them: the SuperLink operator registers each
  public key (``flwr supernode register supernode-<i>.pub``), the SuperNode proves its identity
  with the private key (``flower-supernode --auth-supernode-private-key supernode-<i>``).

Existing files are never overwritten (a second SuperNode batch: ``--first-node 3``); private keys
are written with mode 0600. Uses the ``cryptography`` package that Flower itself depends on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


def _write(path: Path, data: bytes, private: bool = False) -> None:
    if path.exists():
        raise FileExistsError(f"{path} exists; credentials are never overwritten (remove it, or write to another folder)")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "FedTOPS deployment"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def san_entries(addresses: list[str]) -> list[x509.GeneralName]:
    """IP addresses as IP SANs, anything else as DNS SANs; loopback always included, no repeats."""
    out: list[x509.GeneralName] = []
    for address in ["127.0.0.1", "localhost", *addresses]:
        try:
            entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(address))
        except ValueError:
            entry = x509.DNSName(address)
        if entry not in out:
            out.append(entry)
    return out


def make_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("FedTOPS deployment CA"))
        .issuer_name(_name("FedTOPS deployment CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA384())
    )
    _write(folder / "ca.key", _pem_key(key), private=True)
    _write(folder / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def make_superlink_cert(folder: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, addresses: list[str]) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("superlink"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(san_entries(addresses)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write(folder / "superlink.key", _pem_key(key), private=True)
    _write(folder / "superlink.crt", cert.public_bytes(serialization.Encoding.PEM))
    return cert


def make_supernode_keys(folder: Path, index: int) -> Path:
    """``supernode-<index>`` (OpenSSH private key) and ``.pub``; the private key's path."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    path = folder / f"supernode-{index}"
    _write(path, private, private=True)
    _write(folder / f"supernode-{index}.pub", public + f" supernode-{index}\n".encode())
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/credentials.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--superlink-address", action="append", default=[], help="an IP or DNS name clients use for the SuperLink (repeat)")
    parser.add_argument("--supernodes", type=int, default=0, help="SuperNode key pairs to create")
    parser.add_argument("--first-node", type=int, default=0, help="index of the first key pair (default 0)")
    parser.add_argument("--no-tls", action="store_true", help="key pairs only: no CA, no SuperLink certificate")
    args = parser.parse_args(argv)
    if args.supernodes < 0 or args.first_node < 0:
        parser.error("--supernodes and --first-node must be >= 0")
    args.folder.mkdir(parents=True, exist_ok=True)
    try:
        if not args.no_tls:
            ca, ca_key = make_ca(args.folder)
            make_superlink_cert(args.folder, ca, ca_key, args.superlink_address)
        for i in range(args.first_node, args.first_node + args.supernodes):
            make_supernode_keys(args.folder, i)
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"credentials in {args.folder.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
