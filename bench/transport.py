"""One float32 tensor echoed between two processes on loopback: pipesvc's links vs TCP vs gloo.

Every transport does the same thing: process A sends the tensor, process B receives it whole and
sends it back, A receives it whole; MB/s counts both directions (2 x bytes per round trip).

- pipesvc: ``DownstreamLink`` (A) -> ``Exchange`` bidi stream -> ``UpstreamLink`` (B), i.e. the
  real stage data plane (shared-memory handshake, identity checks, mailboxes, send queues,
  gRPC options of ``pipesvc.wire.transport``, the malloc settings of ``pipesvc stage``); B's
  servicer echoes each activation back as a gradient instead of running a StageService schedule.
  Both processes share this host's ``/dev/shm``, so payloads go through shared memory and the
  stream carries headers.
- pipesvc-frames: the same with shared memory off (``shm_bytes=0``): payloads travel as 1 MiB
  frames on the stream, as between stages on different hosts.
- grpc: a plain gRPC bidirectional stream of ``bytes`` messages (no serializers): A sends the
  tensor's bytes as one message, B echoes the message, A turns it back into a tensor (``bytes``
  and ``frombuffer``, as any Python gRPC client must). The floor any gRPC data plane in Python
  sits on.
- grpc-handoffs: the same echo with pipesvc's threads (see [Note: stream threads] below): in
  each process the bytes pass between a compute thread and the gRPC stream through queues, a
  reading thread takes the incoming messages, and gRPC's own threads send from a generator.
- grpc-aio: the same hand-offs over ``grpc.aio`` (a stream on an event loop, each process's
  compute thread handing its messages to the loop and taking the loop's), the design that moves
  the streams off gRPC's threads but keeps the compute (torch) on a thread of its own.
- tcp: a plain socket, ``sendall`` of the tensor's buffer, ``recv_into`` a preallocated buffer.
- gloo: ``torch.distributed`` send/recv, ``init_method=tcp://127.0.0.1:PORT``.

[Note: stream threads] A stage's compute runs on one thread and blocks in torch, so its data
plane needs at least one hand-off per message between that thread and whatever drives the
stream. ``grpc-handoffs`` and ``grpc-aio`` isolate what the two threading designs cost per
message, with nothing of pipesvc in them: ``frames/handoffs`` is what pipesvc's own code adds
on top of its threads, and ``aio/handoffs`` what moving the streams onto an event loop would
buy.

Usage: ``python bench/transport.py [--quick] [--sizes 64K,1M,8M] [--only frames,grpc]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import grpc

SIZES_BYTES = [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES_BYTES = [64 << 10, 1 << 20, 4 << 20]
DEFAULT_SHM_BYTES = 256 << 20  # as `pipesvc stage --shm-bytes` defaults to
WARMUP_ROUND_TRIPS = 3
Plan = list[tuple[int, int]]  # (tensor bytes, timed round trips)
Queue = Any  # multiprocessing.Queue (its class is not importable for annotations)


def _plan(sizes: list[int], budget_bytes: int, max_iters: int) -> Plan:
    return [(n, max(3, min(max_iters, budget_bytes // n))) for n in sizes]


def _timed(plan: Plan, round_trip: Callable[[torch.Tensor], None]) -> list[float]:
    seconds = []
    for num_bytes, iters in plan:
        x = torch.randn(num_bytes // 4)
        for _ in range(WARMUP_ROUND_TRIPS):
            round_trip(x)
        start = time.perf_counter()
        for _ in range(iters):
            round_trip(x)
        seconds.append(time.perf_counter() - start)
    return seconds


def _pipesvc_server(q: Queue, plan: Plan, shm_bytes: int = DEFAULT_SHM_BYTES) -> None:
    from pipesvc.core.tensor_codec import CodecLimits
    from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
    from pipesvc.stage.dataplane.malloc import tune_malloc
    from pipesvc.stage.net.links import UpstreamLink
    from pipesvc.stage.server import add_stage_service
    from pipesvc.v1 import stage_pb2_grpc
    from pipesvc.wire.transport import create_server

    torch.set_num_threads(1)
    tune_malloc()  # as `pipesvc stage` does
    total = sum(WARMUP_ROUND_TRIPS + iters for _, iters in plan)
    done = threading.Event()

    class Echo(stage_pb2_grpc.StageServiceServicer):
        def Exchange(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
            mailbox = Mailbox()
            link = UpstreamLink(
                job_id="bench",
                epoch=1,
                mailbox=mailbox,
                limits=CodecLimits(),
                shm_bytes=shm_bytes,
            )

            def echo() -> None:
                for i in range(total):
                    tensor = mailbox.get(MailKey(1, ACTIVATION, i), 600.0)
                    link.send(MailKey(1, GRADIENT, i), tensor)
                done.set()

            threading.Thread(target=echo, daemon=True).start()
            yield from link.serve(requests)

    # Echo(): mypy-protobuf's stub declares every RPC of the servicer abstract; the generated
    # class answers those Echo leaves out with UNIMPLEMENTED.
    server, port, _ = create_server(
        "127.0.0.1:0",
        [lambda s: add_stage_service(Echo(), s)],  # type: ignore[abstract]
    )
    q.put(f"127.0.0.1:{port}")
    done.wait(900)
    time.sleep(1.0)  # let the last frames leave before the server stops
    server.stop(grace=2)


def _pipesvc_client(q: Queue, address: str, plan: Plan, shm_bytes: int = DEFAULT_SHM_BYTES) -> None:
    from pipesvc.core.tensor_codec import CodecLimits
    from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
    from pipesvc.stage.dataplane.malloc import tune_malloc
    from pipesvc.stage.net.links import DownstreamLink
    from pipesvc.wire.transport import open_channel

    torch.set_num_threads(1)
    tune_malloc()  # as `pipesvc stage` does
    mailbox = Mailbox()
    channel = open_channel(address)
    link = DownstreamLink(
        channel=channel,
        address=address,
        job_id="bench",
        epoch=1,
        mailbox=mailbox,
        limits=CodecLimits(),
        shm_bytes=shm_bytes,
    )
    counter = iter(range(1 << 30))

    def round_trip(x: torch.Tensor) -> None:
        i = next(counter)
        link.send(MailKey(1, ACTIVATION, i), x)
        y = mailbox.get(MailKey(1, GRADIENT, i), 600.0)
        if i == 0 and not torch.equal(x, y):
            raise RuntimeError("pipesvc echo returned a different tensor")
        if i == WARMUP_ROUND_TRIPS and link.uses_shm != bool(shm_bytes):
            raise RuntimeError(f"shared memory in use: {link.uses_shm}; asked: {bool(shm_bytes)}")

    q.put(_timed(plan, round_trip))
    link.close()
    channel.close()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the socket")
        got += n


def _tcp_server(q: Queue, plan: Plan) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    q.put(f"127.0.0.1:{listener.getsockname()[1]}")
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for num_bytes, iters in plan:
        view = memoryview(bytearray(num_bytes))
        for _ in range(WARMUP_ROUND_TRIPS + iters):
            _recv_exact(sock, view)
            sock.sendall(view)
    sock.close()
    listener.close()


def _tcp_client(q: Queue, address: str, plan: Plan) -> None:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffers: dict[int, memoryview] = {}

    def round_trip(x: torch.Tensor) -> None:
        payload = memoryview(x.numpy().data).cast("B")
        view = buffers.setdefault(len(payload), memoryview(bytearray(len(payload))))
        sock.sendall(payload)
        _recv_exact(sock, view)

    q.put(_timed(plan, round_trip))
    sock.close()


def _gloo_init(address: str, rank: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )


def _gloo_server(q: Queue, plan: Plan) -> None:
    import torch.distributed as dist

    with socket.socket() as probe:  # a free port for rank 0's store (rank 0 binds it)
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    q.put(address)
    _gloo_init(address, rank=1)
    for num_bytes, iters in plan:
        buf = torch.empty(num_bytes // 4)
        for _ in range(WARMUP_ROUND_TRIPS + iters):
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
    dist.destroy_process_group()


def _gloo_client(q: Queue, address: str, plan: Plan) -> None:
    import torch.distributed as dist

    _gloo_init(address, rank=0)
    buffers: dict[int, torch.Tensor] = {}

    def round_trip(x: torch.Tensor) -> None:
        buf = buffers.setdefault(x.numel(), torch.empty_like(x))
        dist.send(x, dst=1)
        dist.recv(buf, src=1)

    q.put(_timed(plan, round_trip))
    dist.destroy_process_group()


_ECHO_METHOD = "/bench.Echo/Echo"


def _grpc_server(q: Queue, plan: Plan) -> None:
    torch.set_num_threads(1)
    total = sum(WARMUP_ROUND_TRIPS + iters for _, iters in plan)
    done = threading.Event()

    def echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for i, message in enumerate(requests):
            yield message
            if i + 1 == total:
                done.set()

    _serve_echo(q, echo, done)


def _echo_stream(address: str) -> tuple[Any, Any, Iterator[bytes]]:
    """A channel to the echo, the queue its requests are taken from (None ends them), and
    its replies."""
    import queue as queue_mod

    from pipesvc.wire.transport import open_channel

    torch.set_num_threads(1)
    channel = open_channel(address)
    outbox: queue_mod.Queue[bytes | None] = queue_mod.Queue()

    def requests() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item

    echo: grpc.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(_ECHO_METHOD)
    return channel, outbox, echo(requests())


def _grpc_client(q: Queue, address: str, plan: Plan) -> None:
    channel, outbox, replies = _echo_stream(address)

    def round_trip(x: torch.Tensor) -> None:
        # numpy's stubs give ndarray __buffer__ on Python 3.12+ only (a Buffer on 3.11 too)
        outbox.put(bytes(memoryview(x.numpy()).cast("B")))  # type: ignore[arg-type]
        reply = next(replies)
        torch.frombuffer(bytearray(reply), dtype=torch.float32)

    q.put(_timed(plan, round_trip))
    outbox.put(None)
    channel.close()


def _handoff_server(q: Queue, plan: Plan) -> None:
    import queue as queue_mod

    torch.set_num_threads(1)
    total = sum(WARMUP_ROUND_TRIPS + iters for _, iters in plan)
    done = threading.Event()

    def echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        inbox: queue_mod.Queue[bytes | None] = queue_mod.Queue()
        outbox: queue_mod.Queue[bytes | None] = queue_mod.Queue()

        def read() -> None:  # a stream's reading thread, as a link has
            for message in requests:
                inbox.put(message)
            inbox.put(None)

        def compute() -> None:  # the stage's compute thread
            for i in range(total):
                message = inbox.get()
                outbox.put(message)
                if i + 1 == total:
                    done.set()
            outbox.put(None)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=compute, daemon=True).start()
        while (message := outbox.get()) is not None:
            yield message

    _serve_echo(q, echo, done)


def _serve_echo(q: Queue, echo: Callable[..., Any], done: threading.Event) -> None:
    import grpc

    from pipesvc.wire.transport import create_server

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server, port, _ = create_server(
        "127.0.0.1:0", [lambda s: s.add_generic_rpc_handlers((handler,))]
    )
    q.put(f"127.0.0.1:{port}")
    done.wait(900)
    time.sleep(1.0)  # let the last reply leave before the server stops
    server.stop(grace=2)


def _handoff_client(q: Queue, address: str, plan: Plan) -> None:
    import queue as queue_mod

    channel, outbox, replies = _echo_stream(address)
    inbox: queue_mod.Queue[bytes] = queue_mod.Queue()

    def read() -> None:  # the link's reading thread
        for reply in replies:
            inbox.put(reply)

    threading.Thread(target=read, daemon=True).start()

    def round_trip(x: torch.Tensor) -> None:
        # numpy's stubs give ndarray __buffer__ on Python 3.12+ only (a Buffer on 3.11 too)
        outbox.put(bytes(memoryview(x.numpy()).cast("B")))  # type: ignore[arg-type]
        torch.frombuffer(bytearray(inbox.get()), dtype=torch.float32)

    q.put(_timed(plan, round_trip))
    outbox.put(None)
    channel.close()


_AIO_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def _aio_server(q: Queue, plan: Plan) -> None:
    import asyncio
    import queue as queue_mod

    import grpc

    torch.set_num_threads(1)
    total = sum(WARMUP_ROUND_TRIPS + iters for _, iters in plan)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        async def echo(requests: Any, context: Any) -> Any:
            inbox: queue_mod.Queue[bytes] = queue_mod.Queue()
            outbox: asyncio.Queue[bytes] = asyncio.Queue()

            def compute() -> None:  # the stage's compute thread
                for _ in range(total):
                    message = inbox.get()
                    loop.call_soon_threadsafe(outbox.put_nowait, message)

            async def read() -> None:
                async for message in requests:
                    inbox.put(message)

            threading.Thread(target=compute, daemon=True).start()
            reading = asyncio.ensure_future(read())
            for _ in range(total):
                yield await outbox.get()
            done.set()
            reading.cancel()

        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
        )
        server = grpc.aio.server(options=_AIO_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        q.put(f"127.0.0.1:{port}")
        await done.wait()
        await asyncio.sleep(1.0)  # let the last reply leave before the server stops
        await server.stop(grace=2)

    asyncio.run(serve())


def _aio_client(q: Queue, address: str, plan: Plan) -> None:
    import asyncio
    import queue as queue_mod

    import grpc

    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    inbox: queue_mod.Queue[bytes] = queue_mod.Queue()

    async def open_call() -> Any:
        channel = grpc.aio.insecure_channel(address, options=_AIO_OPTIONS)
        echo: grpc.aio.StreamStreamMultiCallable[bytes, bytes]
        echo = channel.stream_stream(_ECHO_METHOD)
        call = echo()

        async def read() -> None:
            async for reply in call:
                inbox.put(reply)

        reading = asyncio.ensure_future(read())
        return channel, call, reading

    channel, call, _reading = asyncio.run_coroutine_threadsafe(open_call(), loop).result()

    def round_trip(x: torch.Tensor) -> None:
        # numpy's stubs give ndarray __buffer__ on Python 3.12+ only (a Buffer on 3.11 too)
        message = bytes(memoryview(x.numpy()).cast("B"))  # type: ignore[arg-type]
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(call.write(message)))
        torch.frombuffer(bytearray(inbox.get()), dtype=torch.float32)

    q.put(_timed(plan, round_trip))
    asyncio.run_coroutine_threadsafe(channel.close(), loop).result()
    loop.call_soon_threadsafe(loop.stop)


def _frames_server(q: Queue, plan: Plan) -> None:
    _pipesvc_server(q, plan, shm_bytes=0)


def _frames_client(q: Queue, address: str, plan: Plan) -> None:
    _pipesvc_client(q, address, plan, shm_bytes=0)


TRANSPORTS: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    "pipesvc": (_pipesvc_server, _pipesvc_client),
    "pipesvc-frames": (_frames_server, _frames_client),
    "grpc": (_grpc_server, _grpc_client),
    "grpc-handoffs": (_handoff_server, _handoff_client),
    "grpc-aio": (_aio_server, _aio_client),
    "tcp": (_tcp_server, _tcp_client),
    "gloo": (_gloo_server, _gloo_client),
}


def run_pair(name: str, plan: Plan) -> list[float]:
    """Starts the echoing process and the timing one; returns seconds per plan entry."""
    server_fn, client_fn = TRANSPORTS[name]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=server_fn, args=(q, plan), daemon=True)
    server.start()
    address = q.get(timeout=120)
    client = ctx.Process(target=client_fn, args=(q, address, plan), daemon=True)
    client.start()
    try:
        seconds: list[float] = q.get(timeout=1800)
    finally:
        client.join(timeout=30)
        server.join(timeout=30)
        for role, proc in (("client", client), ("server", server)):
            if proc.is_alive():
                proc.terminate()
            elif proc.exitcode:  # after its result was sent; the numbers stand
                print(f"note: {name} {role} exited with {proc.exitcode}", file=sys.stderr)
    return seconds


def _short(name: str) -> str:
    return name.replace("pipesvc-frames", "frames").replace("grpc-", "")


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


RATIOS = [
    ("pipesvc", "gloo"),
    ("pipesvc", "tcp"),
    ("pipesvc-frames", "gloo"),
    ("pipesvc-frames", "grpc"),
    ("pipesvc-frames", "grpc-handoffs"),
    ("grpc-aio", "grpc-handoffs"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few round trips")
    parser.add_argument("--sizes", help="comma-separated tensor sizes, e.g. 64K,1M,8M")
    parser.add_argument(
        "--only", help=f"comma-separated transports (default all: {','.join(TRANSPORTS)})"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each transport, in turns; medians shown"
    )
    args = parser.parse_args()
    sizes = QUICK_SIZES_BYTES if args.quick else SIZES_BYTES
    if args.sizes:
        sizes = [_size(t) for t in args.sizes.split(",")]
    if args.quick:
        plan = _plan(sizes, budget_bytes=32 << 20, max_iters=20)
    else:
        plan = _plan(sizes, budget_bytes=512 << 20, max_iters=200)
    names = args.only.split(",") if args.only else list(TRANSPORTS)
    runs: dict[str, list[list[float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(run_pair(name, plan))
    mb_s = {
        name: [
            statistics.median(2 * n * it / r[i] / 1e6 for r in runs[name])
            for i, (n, it) in enumerate(plan)
        ]
        for name in names
    }
    print(
        "\nEcho round trips of one float32 tensor between two processes on loopback; MB/s "
        "(1e6 B/s) counts both directions.\npipesvc = DownstreamLink -> Exchange stream -> "
        "UpstreamLink (pipesvc.stage.net.links) with an echo servicer in place of StageService;\n"
        "its payloads go through shared memory (both processes share this host's /dev/shm);\n"
        "frames = the same with shared memory off (--shm-bytes 0): payloads in frames on the\n"
        "stream, as between stages on different hosts; grpc = a plain gRPC bytes echo.\n"
        f"Medians of {args.rounds} run(s) of each, in turns.\n"
    )
    header = ["size", "round trips", *(f"{n} MB/s" for n in names)]
    if "pipesvc-frames" in names:
        header.append("frames us/RT")
    ratios = [(a, b) for a, b in RATIOS if a in names and b in names]
    header += [_short(f"{a}/{b}") for a, b in ratios]
    rows = [header]
    for i, (num_bytes, iters) in enumerate(plan):
        row = [_label(num_bytes), str(iters), *(f"{mb_s[n][i]:.0f}" for n in names)]
        if "pipesvc-frames" in names:
            row.append(f"{2 * num_bytes / mb_s['pipesvc-frames'][i]:.0f}")
        row += [f"{mb_s[a][i] / mb_s[b][i]:.2f}" for a, b in ratios]
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
