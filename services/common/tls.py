"""TLS between our own processes: the files a process presents and trusts, their flags, and
the gRPC credentials made from them.

- `--tls-cert` / `--tls-key`: this process's certificate chain and private key (PEM). A server
  given them serves only TLS: a plaintext client fails its handshake.
- `--tls-ca`: the CA that signs every part's certificate. Given it, the connection is mutual: a
  server refuses a client whose certificate that CA did not sign (or that sends none), and a
  client trusts only servers that CA signed. Without it a client trusts the system's roots
  (gRPC's bundled ones, or $GRPC_DEFAULT_SSL_ROOTS_FILE_PATH).
- `--tls-server-name`: the name a client checks in the server's certificate instead of the host
  it dials. Pods are dialled by IP (what they register in Redis), so the chart gives every pod
  a certificate for one fixed name and sets this flag; without it the dialled host must match.

Each flag defaults to an environment variable (SPLITSERVE_TLS_CERT, ..._KEY, ..._CA,
..._SERVER_NAME) so the chart can set them once per container.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

ENV_PREFIX = "SPLITSERVE_TLS_"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files, read when credentials are made (cert-manager rotates them in place)."""

    cert: str  # certificate chain this process presents
    key: str  # its private key; never logged
    ca: str | None = None  # set: mutual TLS, peers must chain to this CA
    server_name: str | None = None  # name expected in servers' certificates (clients)

    def __post_init__(self) -> None:
        files = (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca))
        for flag, path in files:
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file {path!r}")

    @property
    def is_mutual(self) -> bool:
        return self.ca is not None

    def describe(self) -> str:
        """For the start-up log line: paths and mode, never the key's contents."""
        mode = "mutual TLS (clients need a certificate from the CA)" if self.is_mutual else "TLS"
        return f"{mode}, certificate {self.cert}"


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS between the parts (docs/security.md)")
    env = os.environ.get
    group.add_argument(
        "--tls-cert",
        default=env(f"{ENV_PREFIX}CERT") or None,
        metavar="PEM",
        help="serve gRPC over TLS with this certificate (and --tls-key); also presented as the "
        "client certificate when dialling other parts",
    )
    group.add_argument("--tls-key", default=env(f"{ENV_PREFIX}KEY") or None, metavar="PEM")
    group.add_argument(
        "--tls-ca",
        default=env(f"{ENV_PREFIX}CA") or None,
        metavar="PEM",
        help="mutual TLS: accept and trust only peers whose certificate this CA signed",
    )
    group.add_argument(
        "--tls-server-name",
        default=env(f"{ENV_PREFIX}SERVER_NAME") or None,
        metavar="NAME",
        help="name to check in servers' certificates instead of the dialled host",
    )


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    """None when no TLS flag is set; ValueError (naming the flag) for an incomplete set."""
    cert, key = args.tls_cert, args.tls_key
    if cert is None and key is None:
        if args.tls_ca is not None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS)")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return TlsFiles(cert, key, args.tls_ca, args.tls_server_name)


def tls_argv(tls: TlsFiles | None) -> list[str]:
    """The flags that give another process the same files (`splitserve up`)."""
    if tls is None:
        return []
    argv = ["--tls-cert", tls.cert, "--tls-key", tls.key]
    if tls.ca is not None:
        argv += ["--tls-ca", tls.ca]
    if tls.server_name is not None:
        argv += ["--tls-server-name", tls.server_name]
    return argv


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS only; with a CA, a client certificate that chains to it is required."""
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))],
        root_certificates=_read(tls.ca),
        require_client_auth=tls.is_mutual,
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Trusts the CA (else the system roots) and presents this process's certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )


def channel_options(tls: TlsFiles) -> list[tuple[str, str]]:
    if tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]
