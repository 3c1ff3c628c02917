"""Who may talk to a server: a shared token and TLS material, as plain data (no gRPC here).

[Note: auth] With a token, every RPC except grpc.health.v1 must carry it as
``authorization: Bearer <token>`` metadata; servers compare it in constant time. With TLS, every
server presents ``cert``; with ``ca`` as well, servers require client certificates signed by it
(mutual TLS) and every client, stage and coordinator verifies its peer against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipesvc.errors import InvalidArgumentError, NotFoundError

AUTH_METADATA_KEY = "authorization"


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise NotFoundError(f"{what} file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read {what} file {str(path)!r}: {exc}") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class TLSConfig:
    """PEM material for TLS on one side of a connection."""

    ca: bytes | None = None
    """CA certificates that peers must chain to. On a server it turns on mutual TLS."""
    cert: bytes | None = None
    """This side's certificate chain (servers always; clients for mutual TLS)."""
    key: bytes | None = None
    """The private key of ``cert``."""
    server_name: str | None = None
    """Name to verify the server certificate against instead of the dialled host."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgumentError("a TLS certificate and its key must be given together")

    @classmethod
    def from_files(
        cls,
        *,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TLSConfig:
        """Reads PEM files.

        Raises:
            NotFoundError: a file does not exist.
            InvalidArgumentError: a file cannot be read, or cert without key.
        """
        return cls(
            ca=_read(ca, "TLS CA") if ca else None,
            cert=_read(cert, "TLS certificate") if cert else None,
            key=_read(key, "TLS key") if key else None,
            server_name=server_name,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Security:
    """Token and TLS settings shared by a process's servers and channels."""

    token: str | None = None
    """Shared secret every RPC must carry; None turns auth off."""
    tls: TLSConfig | None = field(default=None)
    """TLS material; None for plaintext."""

    def __post_init__(self) -> None:
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise InvalidArgumentError("a token must be non-empty and contain no whitespace")

    @property
    def authenticated(self) -> bool:
        """Whether callers must prove who they are (token or client certificates)."""
        return self.token is not None or (self.tls is not None and self.tls.ca is not None)

    @classmethod
    def from_files(
        cls,
        *,
        token_file: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls_ca: str | Path | None = None,
    ) -> Security:
        """Reads a token file (first line, stripped) and TLS PEM files.

        Raises:
            NotFoundError: a file does not exist.
            InvalidArgumentError: an empty token or cert without key.
        """
        token = None
        if token_file:
            token = _read(token_file, "token").decode("utf-8", "replace").strip()
            if not token:
                raise InvalidArgumentError(f"token file {str(token_file)!r} is empty")
        tls = None
        if tls_cert or tls_key or tls_ca:
            tls = TLSConfig.from_files(ca=tls_ca, cert=tls_cert, key=tls_key)
        return cls(token=token, tls=tls)
