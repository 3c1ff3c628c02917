"""The data plane's two paths: shared memory between stages on one host, frames otherwise."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pipesvc.core.tensor_codec import CodecLimits
from pipesvc.errors import StageUnavailableError, StepAbortedError
from pipesvc.observe.metrics import NO_METRICS
from pipesvc.stage.dataplane.frame_wire import InFrame, OutFrame
from pipesvc.stage.dataplane.mailbox import ACTIVATION, GRADIENT, Mailbox, MailKey
from pipesvc.stage.dataplane.reader import FrameReader
from pipesvc.stage.dataplane.sender import SEND_QUEUE_ITEMS, Sender
from pipesvc.stage.net.links import DownstreamLink, UpstreamLink
from pipesvc.stage.server import add_stage_service
from pipesvc.v1 import stage_pb2, stage_pb2_grpc
from pipesvc.wire.transport import create_server, open_channel

SIZES = [1, 1000, 3 << 20, 0, 5, (1 << 20) + 3]


class _Echo(stage_pb2_grpc.StageServiceServicer):  # type: ignore[misc]
    """Echoes each activation back as a gradient through a real UpstreamLink."""

    def __init__(self, shm_bytes: int, limits: CodecLimits | None = None) -> None:
        self.shm_bytes = shm_bytes
        self.limits = limits or CodecLimits()
        self.link: UpstreamLink | None = None

    def Exchange(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        mailbox = Mailbox()
        link = UpstreamLink(
            job_id="j", epoch=1, mailbox=mailbox, limits=self.limits, shm_bytes=self.shm_bytes
        )
        self.link = link

        def echo() -> None:
            for i in range(len(SIZES)):
                tensor = mailbox.get(MailKey(1, ACTIVATION, i), 30.0)
                link.send(MailKey(1, GRADIENT, i), tensor * 2)

        threading.Thread(target=echo, daemon=True).start()
        yield from link.serve(requests)


def _shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("pipesvc-")}


@pytest.mark.parametrize(
    ("down_shm", "up_shm"),
    [(256 << 20, 256 << 20), (0, 0), (256 << 20, 0), (0, 256 << 20)],
    ids=["both-shm", "both-frames", "only-upstream-offers", "only-downstream-offers"],
)
def test_echo_is_exact_on_every_path(down_shm: int, up_shm: int) -> None:
    """A stage with shm_bytes 0 neither offers an area nor maps its peer's: shared memory is
    used only where both ends have it on, both ways; frames carry everything else."""
    before = _shm_files()
    echo = _Echo(up_shm)
    server, port, _ = create_server("127.0.0.1:0", [lambda s: add_stage_service(echo, s)])
    channel = open_channel(f"127.0.0.1:{port}")
    mailbox = Mailbox()
    link = DownstreamLink(
        channel=channel,
        address="echo",
        job_id="j",
        epoch=1,
        mailbox=mailbox,
        limits=CodecLimits(),
        shm_bytes=down_shm,
    )
    try:
        for i, numel in enumerate(SIZES):
            x = torch.randn(numel, generator=torch.Generator().manual_seed(i))
            link.send(MailKey(1, ACTIVATION, i), x)
            assert torch.equal(mailbox.get(MailKey(1, GRADIENT, i), 30.0), x * 2)
        assert echo.link is not None
        both = bool(down_shm and up_shm)
        assert link.uses_shm == both
        assert echo.link.uses_shm == both
        # Accepted areas are unlinked at once; the others when their stream ends.
        assert _shm_files() - before == set()
    finally:
        link.close()
        channel.close()
        server.stop(1).wait(5)
    assert _shm_files() - before == set()


@pytest.mark.parametrize("frame_bytes", [1 << 10, 1 << 20, 3 << 20])
def test_frames_of_any_size_carry_tensors_exactly(frame_bytes: int) -> None:
    """Frames on a real stream, both ways, cut to ``max_frame_bytes``: tensors of one frame
    (received without a copy) and of several (assembled) arrive equal to what was sent, in
    order, and a received tensor can be written to without changing the next one."""
    limits = CodecLimits(max_frame_bytes=frame_bytes)
    echo = _Echo(0, limits)
    server, port, _ = create_server("127.0.0.1:0", [lambda s: add_stage_service(echo, s)])
    channel = open_channel(f"127.0.0.1:{port}")
    mailbox = Mailbox()
    link = DownstreamLink(
        channel=channel,
        address="echo",
        job_id="j",
        epoch=1,
        mailbox=mailbox,
        limits=limits,
        shm_bytes=0,
    )
    try:
        sent = [
            torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(SIZES)
        ]
        for i, x in enumerate(sent):
            link.send(MailKey(1, ACTIVATION, i), x)
        for i, x in enumerate(sent):
            got = mailbox.get(MailKey(1, GRADIENT, i), 30.0)
            assert torch.equal(got, x * 2)
            got.add_(1)  # the stage may write to what it received (an in-place op)
            assert torch.equal(got, x * 2 + 1)
        assert not link.uses_shm
    finally:
        link.close()
        channel.close()
        server.stop(1).wait(5)


@pytest.mark.parametrize(
    ("frame_bytes", "numel", "expected"),
    [(16 << 20, 3 << 20, [12 << 20]), (1 << 20, 600_000, [1 << 20, 1 << 20, 302_848])],
)
def test_a_sender_cuts_tensors_into_frames_of_its_size(
    frame_bytes: int, numel: int, expected: list[int]
) -> None:
    sender = Sender(job_id="j", epoch=1, direction=ACTIVATION, shm_bytes=0, frame_bytes=frame_bytes)
    sender.put((MailKey(1, ACTIVATION, 0), torch.ones(numel)))
    sender.put(None)
    frames = [f for f in sender.frames() if isinstance(f, OutFrame)]
    assert [len(f.data) for f in frames] == expected
    assert [f.frame.frame_index for f in frames] == list(range(len(expected)))
    assert frames[0].frame.header.num_frames == len(expected)


@pytest.mark.parametrize(
    ("message_bytes", "frame_bytes"),
    [(256 << 20, 16 << 20), (8 << 20, 4 << 20), (1, 1)],
)
def test_a_stage_sends_frames_within_half_its_message_limit(
    message_bytes: int, frame_bytes: int
) -> None:
    from pipesvc.core.limits import Limits

    assert Limits(max_message_bytes=message_bytes).codec().max_frame_bytes == frame_bytes


def _reader(
    reply: Sender, direction: str = ACTIVATION, mailbox: Mailbox | None = None
) -> FrameReader:
    return FrameReader(
        job_id="j",
        epoch=1,
        direction=direction,
        mailbox=mailbox if mailbox is not None else Mailbox(),
        limits=CodecLimits(),
        metrics=NO_METRICS,
        reply=reply,
    )


def test_an_area_the_receiver_cannot_map_is_refused_and_frames_flow() -> None:
    """What a stage on another host sees: the offered file does not exist there."""
    sender = Sender(job_id="j", epoch=1, direction=ACTIVATION)
    frames = sender.frames()
    sender.put((MailKey(1, ACTIVATION, 0), torch.ones(3)))
    offer = next(frames)
    assert offer.HasField("shm_offer")
    first = next(frames)  # the first tensor never waits for an answer: frames on the stream
    assert isinstance(first, OutFrame) and len(first.data) == 12

    elsewhere = stage_pb2.DataFrame()
    elsewhere.CopyFrom(offer)
    elsewhere.shm_offer.name = f"pipesvc-{os.getpid()}-1-" + "f" * 32  # no such file on "this host"
    gradients = Sender(job_id="j", epoch=1, direction=GRADIENT)
    _reader(gradients).feed(elsewhere)
    answer = next(gradients.frames())
    assert answer.HasField("shm_answer") and not answer.shm_answer.accepted
    assert "cannot map" in answer.shm_answer.reason

    answer.shm_answer.name = offer.shm_offer.name
    sender.on_answer(answer.shm_answer)
    assert not sender.uses_shm
    assert not os.path.exists("/dev/shm/" + offer.shm_offer.name)  # refused: removed at once
    sender.put((MailKey(1, ACTIVATION, 1), torch.ones(3)))
    frame = next(frames)
    assert isinstance(frame, OutFrame) and len(frame.data) == 12
    sender.put(None)
    assert list(frames) == []


def test_a_slot_without_an_accepted_offer_is_a_wire_error() -> None:
    from pipesvc.core.tensor_codec import make_header
    from pipesvc.errors import WireFormatError

    frame = stage_pb2.DataFrame(
        id=stage_pb2.MicrobatchId(
            job_id="j", plan_epoch=1, run_id=1, direction=stage_pb2.ACTIVATION
        ),
        header=make_header(torch.ones(2)),
        shm_slot=stage_pb2.ShmSlot(seq=1, offset=4096),
    )
    with pytest.raises(WireFormatError, match="on the stream, not the doorbell"):
        _reader(Sender(job_id="j", epoch=1, direction=GRADIENT)).feed(frame)


@pytest.mark.parametrize(
    ("part", "microbatch_index", "ok"), [(2, 0, True), (2, 1, False), (3, 0, False)]
)
def test_only_a_runs_norm_mail_has_a_part_beyond_a_microbatchs_two(
    part: int, microbatch_index: int, ok: bool
) -> None:
    """Part 2 of micro-batch 0 is a run's norm mail (see [Note: norm along the links]); any
    other part beyond 0 and 1 is a wire error, and nothing reaches the mailbox."""
    from pipesvc.core.tensor_codec import make_header
    from pipesvc.errors import WireFormatError

    total = torch.tensor([2.5], dtype=torch.float64)
    frame = stage_pb2.DataFrame(
        id=stage_pb2.MicrobatchId(
            job_id="j",
            plan_epoch=1,
            run_id=1,
            microbatch_index=microbatch_index,
            direction=stage_pb2.ACTIVATION,
            part=part,
        ),
        header=make_header(total),
    )
    mailbox = Mailbox()
    reader = _reader(Sender(job_id="j", epoch=1, direction=GRADIENT), mailbox=mailbox)
    data = memoryview(total.numpy().tobytes())
    if ok:
        assert reader.feed(InFrame(frame, data))
        assert mailbox.get(MailKey(1, ACTIVATION, 0, part), 1.0).item() == 2.5
    else:
        with pytest.raises(WireFormatError, match=f"frame part {part} of micro-batch"):
            reader.feed(InFrame(frame, data))
        assert len(mailbox) == 0


def test_doorbell_frames_are_checked() -> None:
    from pipesvc.core.tensor_codec import make_header
    from pipesvc.errors import WireFormatError
    from pipesvc.stage.dataplane.shm import MAX_AREA_BYTES, ShmArea, ShmView

    area = ShmArea.create(4 << 20)
    assert area is not None
    view = ShmView(area.name, area.nonce, area.size, MAX_AREA_BYTES)
    reader = _reader(Sender(job_id="j", epoch=1, direction=GRADIENT))
    ident = stage_pb2.MicrobatchId(
        job_id="j", plan_epoch=1, run_id=1, direction=stage_pb2.ACTIVATION
    )
    tensor = torch.arange(8, dtype=torch.float32)
    try:
        slot = area.write(tensor)
        assert slot is not None
        good = stage_pb2.DataFrame(
            id=ident,
            header=make_header(tensor),
            shm_slot=stage_pb2.ShmSlot(seq=slot.seq, offset=slot.offset, length=32),
        )
        split = stage_pb2.DataFrame()
        split.CopyFrom(good)
        split.header.num_frames = 2
        with pytest.raises(WireFormatError, match="single frame"):
            reader.feed_slot(view, split)
        short = stage_pb2.DataFrame()
        short.CopyFrom(good)
        short.shm_slot.length = 16
        with pytest.raises(WireFormatError, match="holds 16 bytes"):
            reader.feed_slot(view, short)
        assert reader.feed_slot(view, good) is True
    finally:
        view.close_bell()
        view.close()
        area.close()


def _full_sender(mailbox: Mailbox) -> Sender:
    """A sender whose queue is full and that nobody drains (a stream gRPC stopped reading)."""
    sender = Sender(
        job_id="j", epoch=1, direction=ACTIVATION, shm_bytes=0, run_aborted=mailbox.is_aborted
    )
    for i in range(SEND_QUEUE_ITEMS):
        sender.put((MailKey(1, ACTIVATION, i), torch.ones(1)))
    return sender


def _put_in_thread(sender: Sender, key: MailKey) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def put() -> None:
        try:
            sender.put((key, torch.ones(1)))
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=put, daemon=True)
    thread.start()
    return thread, raised


def test_a_send_waiting_on_an_ended_stream_fails() -> None:
    """[Note: bounded waits]: the stream ends (its call is over) while a send waits for room:
    the send fails with StageUnavailableError instead of waiting forever, and so does every
    later one; ending the stream itself never waits."""
    sender = _full_sender(Mailbox())
    thread, raised = _put_in_thread(sender, MailKey(1, ACTIVATION, SEND_QUEUE_ITEMS))
    sender.close()  # would block on the full queue if it queued its end like a tensor
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], StageUnavailableError), raised
    with pytest.raises(StageUnavailableError, match="has ended"):
        sender.put((MailKey(2, ACTIVATION, 0), torch.ones(1)))
    assert list(sender.frames()) == []  # the queued tensors were dropped with the stream


def test_abort_wakes_a_send_waiting_for_room() -> None:
    """A hung peer keeps the stream open but stops reading: Abort of the run wakes the step's
    send with StepAbortedError (the step then releases its run lock); the stream lives on."""
    mailbox = Mailbox()
    sender = _full_sender(mailbox)
    thread, raised = _put_in_thread(sender, MailKey(1, ACTIVATION, SEND_QUEUE_ITEMS))
    mailbox.abort(1)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], StepAbortedError), raised
    frames = sender.frames()
    assert isinstance(next(frames), OutFrame)  # the stream still drains
    sender.put((MailKey(2, ACTIVATION, 0), torch.ones(1)))
    sender.close()


class _BadGradients(stage_pb2_grpc.StageServiceServicer):  # type: ignore[misc]
    """Answers an Exchange with a good gradient, one of another job, then a good one."""

    def Exchange(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        from pipesvc.core.tensor_codec import make_header

        def frame(mb: int, job_id: str = "j") -> stage_pb2.DataFrame:
            ident = stage_pb2.MicrobatchId(
                job_id=job_id,
                plan_epoch=1,
                run_id=1,
                microbatch_index=mb,
                direction=stage_pb2.GRADIENT,
            )
            data = torch.ones(2).numpy().tobytes()
            return stage_pb2.DataFrame(id=ident, header=make_header(torch.ones(2)), data=data)

        yield frame(0)
        yield frame(1, job_id="other")
        yield frame(2)
        for _ in requests:  # keep the stream open until the link cancels it
            pass


def test_a_bad_gradient_frame_fails_the_mailbox_and_drops_what_follows() -> None:
    """A gradient frame the downstream link rejects fails its mailbox with the typed error
    (not a generic stream failure), after the good frame before it, and nothing after it is
    delivered."""
    from pipesvc.errors import WireFormatError

    server, port, _ = create_server(
        "127.0.0.1:0", [lambda s: add_stage_service(_BadGradients(), s)]
    )
    channel = open_channel(f"127.0.0.1:{port}")
    mailbox = Mailbox()
    link = DownstreamLink(
        channel=channel,
        address=f"127.0.0.1:{port}",
        job_id="j",
        epoch=1,
        mailbox=mailbox,
        limits=CodecLimits(),
        shm_bytes=0,
    )
    try:
        assert torch.equal(mailbox.get(MailKey(1, GRADIENT, 0), 10.0), torch.ones(2))
        with pytest.raises(WireFormatError, match="frame for job 'other'"):
            mailbox.get(MailKey(1, GRADIENT, 2), 10.0)
        assert len(mailbox) == 0  # micro-batch 2's good frame came after the bad one
    finally:
        link.close()
        channel.close()
        server.stop(grace=None)


class _Establishing(stage_pb2_grpc.StageServiceServicer):  # type: ignore[misc]
    """Exchange through a real UpstreamLink; records, when the link is established, how many
    tensors a waiter could already take, and for each activation a waiter took, whether the
    link was established by then (a last stage sends the gradient back on it)."""

    def __init__(self, shm_bytes: int, count: int) -> None:
        self.shm_bytes = shm_bytes
        self.count = count
        self.visible_at_establish: list[int] = []
        self.established_when_taken: list[bool] = []
        self.done = threading.Event()

    def Exchange(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        mailbox = Mailbox()

        def established(link: UpstreamLink) -> None:
            self.visible_at_establish.append(len(mailbox))

        link = UpstreamLink(
            job_id="j",
            epoch=1,
            mailbox=mailbox,
            limits=CodecLimits(),
            shm_bytes=self.shm_bytes,
            on_established=established,
        )

        def take() -> None:
            for i in range(self.count):
                mailbox.get(MailKey(1, ACTIVATION, i), 30.0)
                self.established_when_taken.append(bool(self.visible_at_establish))
            self.done.set()

        threading.Thread(target=take, daemon=True).start()
        yield from link.serve(requests)


@pytest.mark.parametrize("shm_bytes", [256 << 20, 0], ids=["shm", "frames"])
def test_the_upstream_link_is_established_before_its_first_tensor_is_visible(
    shm_bytes: int,
) -> None:
    """[Note: the link before the tensor]: the stream becomes the link gradients go back on
    before a waiter can take the first activation it delivered, so the compute thread never
    finds no upstream link for a gradient of a tensor it already took (a failed first step of
    a job or plan epoch, and a recovery of a healthy job, seen under load)."""
    count = 3
    echo = _Establishing(shm_bytes, count)
    server, port, _ = create_server("127.0.0.1:0", [lambda s: add_stage_service(echo, s)])
    channel = open_channel(f"127.0.0.1:{port}")
    link = DownstreamLink(
        channel=channel,
        address="establishing",
        job_id="j",
        epoch=1,
        mailbox=Mailbox(),
        limits=CodecLimits(),
        shm_bytes=shm_bytes,
    )
    try:
        for i in range(count):
            link.send(MailKey(1, ACTIVATION, i), torch.ones(4))
        assert echo.done.wait(30)
        assert echo.visible_at_establish == [0]
        assert echo.established_when_taken == [True] * count
    finally:
        link.close()
        channel.close()
        server.stop(1).wait(5)
