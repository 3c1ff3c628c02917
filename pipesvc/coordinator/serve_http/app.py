"""The coordinator's one HTTP app: the live page (``pipesvc.observe.dashboard``) and the
OpenAI-compatible API (``openai_api``), behind one guard (``access.Guard``), served by uvicorn
in a thread of the coordinator.

[Note: one HTTP server] The page and the API share the port, the token, the TLS settings and
the request log. uvicorn serves them from its own event loop in a daemon thread; the socket is
bound before that thread starts, so a port in use fails ``serve`` in the caller, and the port
is known at once (0: any free port). With TLS, uvicorn's ssl options get the cluster's
certificate and key (and CA: mutual TLS, a client certificate is required, as on every RPC),
written to a private directory only while uvicorn loads them. uvicorn's access log is off
(it would print query strings, where a careless client may have put the token); the guard
logs each request scrubbed instead.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import tempfile
import threading
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware

from pipesvc.coordinator.serve_http import openai_api
from pipesvc.coordinator.serve_http.access import Access, Guard
from pipesvc.coordinator.serve_http.served_model import Jobs, ServedModels
from pipesvc.observe import dashboard
from pipesvc.wire.security import TLSConfig

logger = logging.getLogger(__name__)


def build_app(snapshot: dashboard.Snapshot, jobs: Jobs, access: Access) -> Starlette:
    """The page's and the API's routes behind the guard."""
    routes = dashboard.routes(snapshot, access) + openai_api.routes(ServedModels(jobs), access)
    return Starlette(routes=routes, middleware=[Middleware(Guard, access=access)])


class HttpServer:
    """uvicorn serving an app on a bound socket, in a daemon thread, until ``close``."""

    def __init__(
        self,
        snapshot: dashboard.Snapshot,
        jobs: Jobs,
        host: str,
        port: int,
        token: str | None,
        tls: TLSConfig | None = None,
    ) -> None:
        """Binds ``host:port`` (0: any free port) and starts serving, over HTTPS when ``tls``
        holds a certificate and key.

        Raises:
            OSError: the address cannot be bound.
        """
        import uvicorn

        secure = tls is not None and tls.cert is not None and tls.key is not None
        self.scheme = "https" if secure else "http"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
            self._socket.listen(128)
            self.port: int = self._socket.getsockname()[1]
            access = Access(token, secure=secure)
            config = uvicorn.Config(
                build_app(snapshot, jobs, access),
                access_log=False,
                log_config=None,
                timeout_keep_alive=30,
                timeout_graceful_shutdown=3,  # open streams are cut after that
                lifespan="off",
            )
            if secure:
                assert tls is not None and tls.cert is not None and tls.key is not None
                _load_tls(config, tls.cert, tls.key, tls.ca)
            else:
                config.load()
        except BaseException:
            self._socket.close()
            raise
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except Exception:
            logger.exception("the HTTP server stopped")

    def close(self) -> None:
        """Stops serving (open streams are cut) and waits for the thread, a few seconds."""
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._socket.close()


def _load_tls(config: object, cert: bytes, key: bytes, ca: bytes | None) -> None:
    """Loads ``config`` (a ``uvicorn.Config``) with the certificate, key and CA (PEM) through
    uvicorn's ssl options; ssl loads them from files only: a private directory, gone once
    read."""
    with tempfile.TemporaryDirectory(prefix="pipesvc-http-") as folder:
        files = {name: Path(folder) / f"{name}.pem" for name in ("cert", "key", "ca")}
        files["key"].touch(mode=0o600)
        files["key"].write_bytes(key)
        files["cert"].write_bytes(cert)
        settings: dict[str, object] = {
            "ssl_certfile": str(files["cert"]),
            "ssl_keyfile": str(files["key"]),
        }
        if ca is not None:
            files["ca"].write_bytes(ca)
            settings |= {"ssl_ca_certs": str(files["ca"]), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        for name, value in settings.items():
            setattr(config, name, value)
        config.load()  # type: ignore[attr-defined]
