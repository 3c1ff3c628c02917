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
from tests.integration.reference import PROBLEMS, Reference

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
    step_seconds: list[float] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        client: pipesvc.Client,
        *,
        num_stages: int = 2,
        checkpoint_every: int = 2,
        optimizer: dict[str, object] | None = None,
    ) -> Run:
        optimizer = optimizer or OPTIMIZER
        job = client.create_job(
            model="mlp",
            model_args=MLP.model_args,
            seed=11,
            num_stages=num_stages,
            num_microbatches=4,
            loss="mse",
            optimizer=optimizer,
            checkpoint_every=checkpoint_every,
        )
        return cls(job, Reference(MLP, seed=11, optimizer=optimizer, clip_grad_norm=None))

    def step(self) -> float:
        number = len(self.step_seconds)
        x, y = MLP.batch(8 + number % 3, seed=number)
        started = time.monotonic()
        loss = self.job.train_step(x, y)
        self.step_seconds.append(time.monotonic() - started)
        assert loss == pytest.approx(self.reference.step(x, y), rel=1e-5, abs=1e-6)
        return loss

    def check_weights(self) -> None:
        weights = self.job.state_dict()
        for key, value in self.reference.model.state_dict().items():
            torch.testing.assert_close(weights[key], value, **FAULT_TOL)


class TcpProxy:
    """Forwards a loopback port to a target; ``hang()`` stops forwarding (a silent link),
    ``reset()`` closes every open connection (a link reset, possibly mid-frame)."""

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
        self._reset_after: int | None = None
        self.resets = 0
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
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._forwarding.wait()
                if self._closed:
                    return
                with self._lock:
                    budget = self._reset_after
                    if budget is not None:
                        self._reset_after = budget - len(data) if budget >= len(data) else None
                if budget is not None and budget < len(data):
                    sink.sendall(data[:budget])  # part of a frame, then the link dies
                    self.reset()
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def hang(self) -> None:
        """Stops forwarding bytes; connections stay open (a link that went silent)."""
        self._forwarding.clear()

    def reset_after(self, num_bytes: int) -> None:
        """Forwards ``num_bytes`` more (in either direction), then resets mid-stream."""
        with self._lock:
            self._reset_after = num_bytes

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
