"""Running the coordinator server: bind, serve until stopped, then release every job."""

from __future__ import annotations

import logging
import threading

import grpc

from pipesvc.coordinator import cluster_view
from pipesvc.coordinator.options import CoordinatorOptions
from pipesvc.coordinator.replicas import Rendezvous
from pipesvc.coordinator.serve_http.app import HttpServer
from pipesvc.coordinator.service import CoordinatorService
from pipesvc.v1 import coordinator_pb2_grpc
from pipesvc.wire.payload_wire import FORWARD, TRAIN_STEP
from pipesvc.wire.transport import Codec, add_service, create_server, split_address

logger = logging.getLogger(__name__)


def add_coordinator_service(service: CoordinatorService, server: grpc.Server) -> None:
    """Registers the coordinator service on ``server``, TrainStep's, Train's and Forward's tensors
    parsed as views of the received bytes (see [Note: payload wire])."""
    add_service(
        lambda s: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(service, s),
        server,
        {
            "TrainStep": Codec(request_deserializer=TRAIN_STEP.parse),
            "Train": Codec(request_deserializer=TRAIN_STEP.parse),
            "Forward": Codec(request_deserializer=FORWARD.parse),
        },
    )


def run_coordinator(options: CoordinatorOptions, stop: threading.Event) -> None:
    """Serves the coordinator until ``stop`` is set.

    ``options.address_file``, when given, receives the bound ``host:port`` once the server is
    up. ``options.http_port``: also serve the live page (``pipesvc.observe.dashboard``) and the
    OpenAI-compatible API (``pipesvc.coordinator.serve_http``) there, on the listen host.
    ``options.store_host``/``store_port``: where the stages of jobs with replicas reach the
    gradient groups' store (see [Note: replicas]).
    """
    listen, security, limits = options.listen, options.security, options.limits
    host, _ = split_address(listen)
    # Said at start with its full path, and whether it is new: a relative default
    # (./pipesvc-state) lands wherever the command ran.
    state_dir = options.state_dir.resolve()
    created = not state_dir.exists()
    state_dir.mkdir(parents=True, exist_ok=True)
    rendezvous = Rendezvous(host=options.store_host, port=options.store_port, bind=host.strip("[]"))
    service = CoordinatorService(
        state_dir,
        options.deadlines,
        security,
        limits,
        options.metrics,
        rendezvous,
        options.forget_stages_after_s,
    )
    service.open()
    server, port, health = create_server(
        listen,
        [lambda s: add_coordinator_service(service, s)],
        security=security,
        limits=limits,
    )
    address = f"{host}:{port}"
    logger.info(
        "coordinator listening on %s, state in %s%s",
        address,
        state_dir,
        " (created)" if created else "",
    )
    page = None
    if options.http_port is not None:
        try:
            # With TLS on, HTTPS only, with the gRPC servers' certificate and CA.
            page = HttpServer(
                lambda: cluster_view.snapshot(service.registry, service.jobs),
                service.jobs,
                host.strip("[]"),
                options.http_port,
                security.token,
                security.tls,
            )
        except OSError:
            server.stop(grace=None)
            service.shutdown()
            raise
        url = f"{page.scheme}://{host}:{page.port}/"
        logger.info("live page on %s", url)
        logger.info("OpenAI-compatible API on %sv1", url)
    if options.address_file is not None:
        tmp = options.address_file.with_suffix(".tmp")
        tmp.write_text(address)
        tmp.replace(options.address_file)
    maintenance = threading.Thread(
        target=service.maintain_forever, args=(stop,), name="maintenance", daemon=True
    )
    maintenance.start()
    try:
        stop.wait()
        logger.info("coordinator stopping: the step in flight finishes, new calls are refused")
    finally:
        if page is not None:
            page.close()
        health.enter_graceful_shutdown()
        service.shutdown()
        # Bounded: grpc's stop can hang after a stream whose request failed to deserialize.
        server.stop(grace=2.0).wait(timeout=5.0)
    logger.info("coordinator stopped cleanly; state kept in %s", state_dir)
