"""Failed connections explained: what could not be reached, the likely cause, what to check.

gRPC reports a wrong port as ``UNKNOWN: ... Connection refused`` inside an UNAVAILABLE status,
a TLS mismatch as a closed socket or an OpenSSL error name, and a call to the wrong kind of
server as ``UNIMPLEMENTED: Method not found!``. ``explain`` turns such a failure of a call to a
pipesvc service into a typed error whose message leads with what went wrong and what to check,
and keeps gRPC's own text at the end for whoever debugs further.

[Note: which server answered] A server that answers UNIMPLEMENTED is up but does not serve the
method; a cheap call of the other pipesvc service (a stage's ``Info``, a coordinator's
``ListStages``) tells which one it is. Any status but UNIMPLEMENTED, UNAUTHENTICATED included,
means the method exists there (unknown methods are refused before the token is checked), so the
probe needs no token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import grpc

from pipesvc import errors
from pipesvc.errors import PipesvcError
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from pipesvc.wire.rpc_status import ERROR_CLASS_KEY, error_from_rpc
from pipesvc.wire.security import Security

PROBE_TIMEOUT_S = 2.0

_PROBES: dict[str, Callable[[grpc.Channel], object]] = {
    "stage": lambda channel: stage_pb2_grpc.StageServiceStub(channel).Info(
        stage_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_S
    ),
    "coordinator": lambda channel: coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListStages(
        coordinator_pb2.ListStagesRequest(), timeout=PROBE_TIMEOUT_S
    ),
}
"""One cheap call per pipesvc service, by the name people know it by."""

_HOW_TO_FIND = {
    "coordinator": "the address the coordinator logged as 'coordinator listening on HOST:PORT', "
    "the one its stages were given as --coordinator",
    "stage": "a stage's address as `pipesvc status` lists it",
}


def explain(
    error: grpc.RpcError, *, what: str, address: str, channel: grpc.Channel, security: Security
) -> PipesvcError:
    """The typed error for a failed call to the ``what`` (``"coordinator"`` or ``"stage"``)
    at ``address`` over ``channel``: as ``error_from_rpc``, but a connection that failed, a
    server of the other kind, and a refused token are explained.

    A server's own typed errors pass through unchanged (but for the token hint).
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        typed = error_from_rpc(error)
        return type(typed)(
            f"{typed}. Check the token for the {what} at {address}: the first line of the "
            "cluster's --token-file, passed as token= (CLI: --token-file)"
        )
    if _from_pipesvc(error):
        return error_from_rpc(error, f"{what} {address}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.StageUnavailableError(
            f"cannot reach the {what} at {address}: {_unreachable(details, what, security)} "
            f"[gRPC: {details}]"
        )
    if code == grpc.StatusCode.UNIMPLEMENTED:
        other = serves(channel, exclude=what)
        if other is not None:
            return errors.WrongServiceError(
                f"{address} is a pipesvc {other}, not a {what}: give the {what}'s address "
                f"({_HOW_TO_FIND.get(what, what)}) [gRPC: {details}]"
            )
        return errors.WrongServiceError(
            f"the server at {address} answers but does not serve the pipesvc {what}'s calls: "
            f"check that the address is a pipesvc {what}'s, of a version matching this client "
            f"[gRPC: {details}]"
        )
    return error_from_rpc(error, f"{what} {address}")


def serves(channel: grpc.Channel, *, exclude: str = "") -> str | None:
    """Which pipesvc service (other than ``exclude``) the server behind ``channel`` serves, or
    None when it serves neither or does not answer ([Note: which server answered])."""
    for name, probe in _PROBES.items():
        if name == exclude:
            continue
        try:
            probe(channel)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            if code in (
                grpc.StatusCode.UNIMPLEMENTED,
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                continue
        return name
    return None


def _from_pipesvc(error: grpc.RpcError) -> bool:
    """Whether a pipesvc server raised the error itself (it names the class)."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    entries = cast("Iterable[tuple[str, str | bytes]]", trailing or ())
    return any(key == ERROR_CLASS_KEY for key, _ in entries)


def _unreachable(details: str, what: str, security: Security) -> str:
    """The likely cause of a failed connection, from gRPC's text, and what to check."""
    tls = security.tls is not None
    mode = "with TLS" if tls else "without TLS (plaintext)"
    if "Connection refused" in details:
        return (
            f"nothing accepts connections there. Check the address and the port, and that the "
            f"{what} is running."
        )
    if "WRONG_VERSION_NUMBER" in details:
        return (
            f"the TLS handshake failed: the {what} probably runs without TLS, and this client "
            "uses TLS. Connect without tls=, or start the cluster with --tls-cert/--tls-key."
        )
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            f"the {what}'s certificate is not signed by the CA this client trusts, or does not "
            "name the host dialled. Check the CA file (tls=TLSConfig.from_files(ca=...); CLI: "
            "--tls-ca) and the server name."
        )
    if "Socket closed" in details or "Connection reset" in details:
        if not tls:
            return (
                f"it closed the connection at once: the {what} probably runs with TLS, and "
                "this client does not. Pass tls=TLSConfig.from_files(ca=...) (CLI: --tls-ca)."
            )
        return (
            f"it closed the connection during the TLS handshake: the {what} probably wants a "
            "client certificate from its CA (mutual TLS, --tls-ca on the servers). Pass cert= "
            "and key= in the TLSConfig (CLI: --tls-cert, --tls-key)."
        )
    if "resolv" in details or "DNS" in details:
        return "the host name does not resolve. Check the address."
    return (
        f"check the address and the port, that the {what} is running, and that it runs {mode} "
        "like this client (TLS on both sides or neither)."
    )
