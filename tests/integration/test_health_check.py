"""``transport.health_check`` on real sockets: a server that is gone (nothing listens, or it
stopped) is told apart from one that is there but does not answer, which the coordinator waits
for (see ``patient_health``)."""

from __future__ import annotations

import socket

from pipesvc.core.health import Health
from pipesvc.wire.transport import create_server, health_check, open_channel


def test_a_serving_server_and_then_the_same_server_stopped() -> None:
    server, port, _ = create_server("127.0.0.1:0", [])
    try:
        with open_channel(f"127.0.0.1:{port}") as channel:
            assert health_check(channel, 5.0) == (Health.SERVING, False)
            server.stop(0).wait()
            assert health_check(channel, 5.0) == (Health.UNREACHABLE, True)
    finally:
        server.stop(0)


def test_an_address_where_nothing_listens_is_gone() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with open_channel(f"127.0.0.1:{port}") as channel:
        assert health_check(channel, 5.0) == (Health.UNREACHABLE, True)


def test_a_listener_that_never_answers_is_silent_not_gone() -> None:
    # The kernel accepts the connection (as for a stopped or hung process); nothing speaks.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with open_channel(f"127.0.0.1:{port}") as channel:
            assert health_check(channel, 0.5) == (Health.UNREACHABLE, False)
