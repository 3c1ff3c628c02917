"""The shared-memory area: slot placement, the handshake checks, and byte-exact copies."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesvc.errors import WireFormatError
from pipesvc.stage.dataplane import shm
from pipesvc.stage.dataplane.shm import ALIGN, HEADER_BYTES, ShmArea, ShmView, SlotAllocator


def _area() -> ShmArea:
    area = ShmArea.create(4 << 20)
    assert area is not None, "/dev/shm is needed for these tests"
    return area


def test_ring_starts_over_when_nothing_is_live() -> None:
    ring = SlotAllocator(1000 * ALIGN)
    first = ring.place(10)
    second = ring.place(10)
    assert first is not None and second is not None
    assert (first.seq, first.offset) == (1, 0)
    assert (second.seq, second.offset) == (2, ALIGN)
    ring.release(2)
    third = ring.place(500)
    assert third is not None and (third.seq, third.offset) == (3, 0)


def test_ring_wraps_and_refuses_when_full() -> None:
    ring = SlotAllocator(4 * ALIGN)
    slots = [ring.place(ALIGN) for _ in range(4)]
    assert [s.offset for s in slots if s] == [0, ALIGN, 2 * ALIGN, 3 * ALIGN]
    assert ring.place(1) is None
    ring.release(2)  # frees the first two
    wrapped = ring.place(2 * ALIGN)
    assert wrapped is not None and wrapped.offset == 0
    assert ring.place(1) is None
    assert ring.place(5 * ALIGN) is None  # larger than the whole ring


def test_ring_retract_reuses_the_sequence_number() -> None:
    ring = SlotAllocator(10 * ALIGN)
    assert ring.place(1) is not None
    ring.retract()
    again = ring.place(1)
    assert again is not None and again.seq == 1 and ring.live == 1


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 700), st.integers(0, 3)), min_size=1, max_size=60))
def test_ring_never_overlaps_live_slots(ops: list[tuple[int, int]]) -> None:
    capacity = 16 * ALIGN
    ring = SlotAllocator(capacity)
    live: list[tuple[int, int, int]] = []  # seq, start, end
    placed = 0
    for size, frees in ops:
        if frees and live:
            upto = live[min(frees, len(live)) - 1][0]
            ring.release(upto)
            live = [s for s in live if s[0] > upto]
        slot = ring.place(size)
        if slot is None:
            continue
        end = slot.offset + size
        assert slot.offset >= 0 and end <= capacity
        placed += 1
        assert slot.seq == placed  # numbered in placing order, from 1, whatever was freed
        for _, start, stop in live:
            assert end <= start or slot.offset >= stop, (slot, live)
        live.append((slot.seq, slot.offset, end))


def _lowest_fit(live: list[tuple[int, int, int]], size: int, capacity: int) -> int | None:
    """Where the lowest slot of ``size`` bytes goes, by brute force over every byte range."""
    rounded = -(-max(size, 1) // ALIGN) * ALIGN
    for start in range(0, capacity - rounded + 1, ALIGN):
        if all(start + rounded <= b or start >= e for _, b, e in live):
            return start
    return None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.integers(1, 5 * ALIGN), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=80,
    )
)
def test_ring_places_lowest_first_and_knows_its_high_end(
    ops: list[tuple[int, int, bool]],
) -> None:
    capacity = 24 * ALIGN
    ring = SlotAllocator(capacity)
    live: list[tuple[int, int, int]] = []  # seq, start, end (rounded)
    for size, frees, retract in ops:
        if frees and live:
            upto = live[min(frees, len(live)) - 1][0]
            ring.release(upto)
            live = [s for s in live if s[0] > upto]
        expected = _lowest_fit(live, size, capacity)
        slot = ring.place(size)
        assert (slot.offset if slot else None) == expected
        if slot is not None:
            if retract:
                ring.retract()
            else:
                live.append((slot.seq, slot.offset, slot.offset + -(-size // ALIGN) * ALIGN))
        assert ring.live == len(live)
        assert ring.high == max((e for _, _, e in live), default=0)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5),
        torch.randn(7).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(10, dtype=torch.int64)[::2],  # not contiguous
        torch.randn(300_000),
    ],
    ids=["f32", "bf16", "bool", "strided", "1mb"],
)
def test_area_to_view_is_byte_exact(tensor: torch.Tensor) -> None:
    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    nbytes = tensor.numel() * tensor.element_size()
    try:
        offsets = set()
        for _ in range(3):  # each slot is freed with its tensor, so the area is reused
            slot = area.write(tensor)
            assert slot is not None
            offsets.add(slot.offset)
            out = view.take(slot.seq, slot.offset, nbytes).view(tensor.dtype).reshape(tensor.shape)
            assert torch.equal(out, tensor)
            del out
        assert offsets == {shm.HEADER_BYTES}
    finally:
        view.close()
        area.close()


def test_area_file_is_gone_after_unlink_and_close() -> None:
    area = _area()
    path = area.path
    assert os.path.exists(path)
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    area.unlink()
    assert not os.path.exists(path)
    slot = area.write(torch.ones(4))  # both mappings outlive the file
    assert slot is not None
    assert torch.equal(view.take(slot.seq, slot.offset, 16).view(torch.float32), torch.ones(4))
    view.close()
    area.close()


def test_full_area_makes_the_sender_fall_back() -> None:
    area = _area()
    big = torch.zeros((area.size - HEADER_BYTES) // 4)
    assert area.write(big) is not None
    assert area.write(torch.zeros(1)) is None  # nothing consumed yet: send frames instead
    assert area.write(torch.zeros(area.size)) is None  # never fits
    area.close()


def test_view_refuses_a_bad_offer() -> None:
    area = _area()
    try:
        with pytest.raises(WireFormatError, match="not pipesvc-"):
            ShmView("../etc/passwd", area.nonce, area.size, shm.MAX_AREA_BYTES)
        with pytest.raises(WireFormatError, match="size"):
            ShmView(area.name, area.nonce, 10, shm.MAX_AREA_BYTES)
        with pytest.raises(OSError, match="nonce"):
            ShmView(area.name, b"x" * 16, area.size, shm.MAX_AREA_BYTES)
        with pytest.raises(OSError, match="regular file"):
            ShmView(area.name, area.nonce, area.size - 4096, shm.MAX_AREA_BYTES)
        with pytest.raises(FileNotFoundError):
            ShmView(
                f"pipesvc-{os.getpid()}-1-" + "0" * 32, area.nonce, area.size, shm.MAX_AREA_BYTES
            )
    finally:
        area.close()


def test_view_refuses_slots_out_of_order_or_outside_the_area() -> None:
    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    try:
        slot = area.write(torch.ones(4))
        assert slot is not None
        with pytest.raises(WireFormatError, match="expected 1"):
            view.take(slot.seq + 1, slot.offset, 16)
        with pytest.raises(WireFormatError, match="outside"):
            view.take(slot.seq, 0, 16)
        with pytest.raises(WireFormatError, match="outside"):
            view.take(slot.seq, area.size - 8, 16)
        assert torch.equal(view.take(slot.seq, slot.offset, 16).view(torch.float32), torch.ones(4))
    finally:
        view.close()
        area.close()


def test_no_area_when_the_limit_is_too_small() -> None:
    assert ShmArea.create(shm.MIN_AREA_BYTES - 1) is None


def test_doorbell_carries_messages_in_order_and_ends_at_close() -> None:
    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    try:
        assert area.open_bell()
        area.unlink()  # both ends stay open without the files
        for i in range(100):
            area.ring(f"message {i}".encode())
        assert [view.read_bell() for _ in range(100)] == [
            f"message {i}".encode() for i in range(100)
        ]
        area.close()
        assert view.read_bell() is None  # end-of-file once the sender is gone
    finally:
        view.close_bell()
        view.close()
        area.close()


def test_doorbell_reader_waits_for_its_first_writer() -> None:
    """read() on a FIFO with no writer returns end-of-file at once; the reader must not take
    that for the sender having gone before the sender has even opened it."""
    import threading

    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(view.read_bell()))
    reader.start()
    reader.join(timeout=0.3)
    assert reader.is_alive() and got == []
    assert area.open_bell()
    area.ring(b"first")
    reader.join(timeout=10)
    assert got == [b"first"]
    view.close_bell()
    view.close()
    area.close()


def test_doorbell_refuses_oversized_messages_and_unopened_bells() -> None:
    area = _area()
    try:
        with pytest.raises(OSError):
            area.ring(b"x")  # no receiver has opened it
        assert not area.open_bell()  # nobody reads it
        with pytest.raises(ValueError, match="at most"):
            area.ring(b"x" * (shm.MAX_BELL_MESSAGE + 1))
    finally:
        area.close()


def test_doorbell_length_prefix_is_checked() -> None:
    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    try:
        assert area.open_bell()
        assert area._bell is not None
        with area._bell.use() as bell:
            os.write(bell, (shm.MAX_BELL_MESSAGE + 1).to_bytes(4, "little"))
        with pytest.raises(WireFormatError, match="doorbell message"):
            view.read_bell()
    finally:
        view.close_bell()
        view.close()
        area.close()


def test_slots_freed_out_of_order_are_published_in_order() -> None:
    """The sender may reuse a slot only once it and every earlier one are free."""
    area = _area()
    view = ShmView(area.name, area.nonce, area.size, shm.MAX_AREA_BYTES)
    try:
        taken = []
        for value in range(3):
            slot = area.write(torch.full((4,), float(value)))
            assert slot is not None
            taken.append(view.take(slot.seq, slot.offset, 16))
        consumed = view._map.consumed
        del taken[1]  # slot 2 freed first: slot 1 still held, nothing published
        assert int(consumed[0]) == 0
        del taken[0]  # slot 1 freed: 1 and 2 published
        assert int(consumed[0]) == 2
        again = area.write(torch.zeros(4))  # the lowest free offset is reused
        assert again is not None and again.offset == shm.HEADER_BYTES
        taken.clear()
    finally:
        view.close()
        area.close()
