"""Helpers for fault tests: a training run checked against the one-process oracle, a TCP
proxy that can hang or reset a link, and stage lookups."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch

import pipesvc
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from tests.support.reference import PROBLEMS, Problem, Reference

MLP = PROBLEMS["mlp"]
FAULT_TOL = {"rtol": 1e-5, "atol": 1e-6}
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def stage_pid(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        info = stage_pb2_grpc.StageServiceStub(channel).Info(stage_pb2.InfoRequest(), timeout=5)
    return int(info.pid)


@dataclass
class Run:
    """A job trained step by step next to the whole model in one process."""

    job: pipesvc.Job
    reference: Reference
    problem: Problem = MLP
    step_seconds: list[float] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        client: pipesvc.Client,
        *,
        num_stages: int = 2,
        checkpoint_every: int = 2,
        optimizer: dict[str, object] | None = None,
        problem: Problem = MLP,
        num_microbatches: int = 4,
    ) -> Run:
        optimizer = optimizer or OPTIMIZER
        job = client.create_job(
            model=problem.model,
            model_args=problem.model_args,
            seed=11,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            loss="mse",
            optimizer=optimizer,
            checkpoint_every=checkpoint_every,
        )
        reference = Reference(problem, seed=11, optimizer=optimizer, clip_grad_norm=None)
        return cls(job, reference, problem)

    def step(self) -> float:
        number = len(self.step_seconds)
        x, y = self.problem.batch(8 + number % 3, seed=number)
        started = time.monotonic()
        loss = self.job.train_step(x, y)
        self.step_seconds.append(time.monotonic() - started)
        assert loss == pytest.approx(self.reference.step(x, y), rel=1e-5, abs=1e-6)
        return loss

    def check_weights(self) -> None:
        weights = self.job.state_dict()
        for key, value in self.reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **FAULT_TOL)


@dataclass(frozen=True)
class Cut:
    """Where :meth:`TcpProxy.cut_data_frame` cut: inside an HTTP/2 DATA frame of
    ``payload_bytes``, after forwarding ``forwarded_bytes`` of that payload."""

    payload_bytes: int
    forwarded_bytes: int


class Http2Scanner:
    """Follows the HTTP/2 frames a client sends (after the 24-byte connection preface), so the
    proxy knows where each DATA frame (type 0: a gRPC message, or part of one) starts and ends.
    The stages talk plaintext HTTP/2 here (no TLS), so the frame headers are readable."""

    def __init__(self) -> None:
        self._preface_left = 24
        self._header = b""
        self._payload_left = 0
        self._type = -1
        self._length = 0

    def cut_offset(self, data: bytes, min_payload: int, into: int) -> tuple[int, Cut] | None:
        """Scans ``data``; where it holds byte ``into`` of a DATA frame's payload of at least
        ``min_payload`` bytes, returns how many bytes of ``data`` to forward before cutting."""
        i = 0
        while i < len(data):
            if self._preface_left:
                take = min(self._preface_left, len(data) - i)
                self._preface_left -= take
            elif not self._payload_left:
                take = min(9 - len(self._header), len(data) - i)
                self._header += data[i : i + take]
                if len(self._header) == 9:
                    self._length = int.from_bytes(self._header[:3], "big")
                    self._type, self._payload_left, self._header = (
                        self._header[3],
                        self._length,
                        b"",
                    )
            else:
                take = min(self._payload_left, len(data) - i)
                done = self._length - self._payload_left
                if self._type == 0 and self._length >= min_payload and done <= into < done + take:
                    return i + into - done, Cut(self._length, into)
                self._payload_left -= take
            i += take
        return None


class TcpProxy:
    """Forwards a loopback port to a target; ``hang()`` stops forwarding (a silent link),
    ``reset()`` closes every open connection (a link reset), ``cut_data_frame()`` resets in the
    middle of the next large DATA frame a client sends (a link reset mid-message)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut_rule: tuple[int, int] | None = None
        self.resets = 0
        self.cuts: list[Cut] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b, scanner in ((client, upstream, Http2Scanner()), (upstream, client, None)):
                threading.Thread(target=self._pump, args=(a, b, scanner), daemon=True).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, scanner: Http2Scanner | None
    ) -> None:
        try:
            while data := source.recv(65536):
                self._forwarding.wait()
                if self._closed:
                    return
                if scanner is not None and self._cut(scanner, data, sink):
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def _cut(self, scanner: Http2Scanner, data: bytes, sink: socket.socket) -> bool:
        """Scans a client's bytes; True when it cut the link inside the armed DATA frame."""
        with self._lock:
            rule = self._cut_rule or (1 << 30, 0)  # unarmed: only keep up with the frames
        found = scanner.cut_offset(data, *rule)
        if found is None:
            return False
        with self._lock:
            if self._cut_rule is None:  # another connection cut first
                return False
            self._cut_rule = None
            self.cuts.append(found[1])
        sink.sendall(data[: found[0]])  # part of a message, then the link dies
        self.reset()
        return True

    def hang(self) -> None:
        """Stops forwarding bytes; connections stay open (a link that went silent)."""
        self._forwarding.clear()

    def cut_data_frame(self, *, min_payload_bytes: int, into_bytes: int) -> None:
        """Arms a cut: the next HTTP/2 DATA frame a client sends with at least
        ``min_payload_bytes`` of payload is forwarded up to ``into_bytes`` of that payload,
        then every connection is reset (recorded in ``cuts``)."""
        if not 0 < into_bytes < min_payload_bytes:
            raise ValueError(f"into_bytes ({into_bytes}) must be in (0, {min_payload_bytes})")
        with self._lock:
            self._cut_rule = (min_payload_bytes, into_bytes)

    def reset(self) -> None:
        """Closes every connection now; new ones are forwarded again."""
        self.resets += 1
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                sock.close()

    def close(self) -> None:
        self._closed = True
        self._forwarding.set()
        self._listener.close()
        self.reset()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
