"""``bench/links.py``'s pure parts: the rates and tbf parameters, the ``ip`` and ``tc`` command
lines of its hosts, and how rounds become table rows (the run itself: the root-only
``tests/cluster/test_links_bench.py``)."""

from __future__ import annotations

import pytest

from bench.links import MIN_BURST_BYTES, RUNS, Rate, Sample, Topology, _rotated, result_rows


def test_rates_parse_as_tc_spells_them() -> None:
    assert Rate.parse("10gbit") == Rate("10gbit", 10**10)
    assert Rate.parse("1gbit") == Rate("1gbit", 10**9)
    assert Rate.parse("100mbit") == Rate("100mbit", 10**8)
    assert Rate.parse("none") == Rate("none", None)
    assert [Rate.parse(t).label for t in ("10gbit", "100mbit", "none")] == [
        "10 Gbit/s",
        "100 Mbit/s",
        "unshaped",
    ]
    for bad in ("1gbps", "fast", "0mbit", ""):
        with pytest.raises(ValueError, match=repr(bad)):
            Rate.parse(bad)


@pytest.mark.parametrize("text", ["10gbit", "1gbit", "100mbit", "1mbit"])
def test_tbf_burst_holds_a_millisecond_and_a_whole_gso_segment(text: str) -> None:
    rate = Rate.parse(text)
    assert rate.bits_per_s is not None
    assert rate.burst_bytes >= MIN_BURST_BYTES
    assert rate.burst_bytes >= rate.bits_per_s // 8 // 1000
    command = rate.tc_command("ns", "dev0")
    assert command[:8] == ["tc", "-n", "ns", "qdisc", "replace", "dev", "dev0", "root"]
    assert command[8:] == ["tbf", "rate", text, "burst", str(rate.burst_bytes), "latency", "50ms"]


def test_unshaped_removes_the_qdisc() -> None:
    assert Rate.parse("none").tc_command("ns", "d") == ["tc", "-n", "ns", "qdisc", "del", "dev",
                                                        "d", "root"]  # fmt: skip


def test_hosts_are_named_after_the_run_and_fit_linux_limits() -> None:
    topo = Topology("4194304")  # the largest pid Linux hands out
    assert set(topo.netns.values()) == {f"pslinks4194304-{h}" for h in ("c", "a", "b")}
    devices = [topo.shaped_dev, topo.bridge]
    devices += [topo.control_dev(h) for h in "ab"] + [topo.bridge_port(h) for h in "ab"]
    assert all(len(d) <= 15 for d in devices), devices  # IFNAMSIZ - 1
    assert len(set(devices)) == len(devices)
    assert all("4194304" in d for d in devices)
    assert Topology("1").netns.keys() == topo.netns.keys()
    assert not set(Topology("1").netns.values()) & set(topo.netns.values())


def test_the_stages_meet_only_over_the_shaped_veth() -> None:
    topo = Topology("77")
    ns = topo.netns
    commands = topo.setup_commands()
    assert commands[:3] == [["ip", "netns", "add", name] for name in ns.values()]
    assert all(c[0] == "ip" for c in commands)
    shaped = [c for c in commands if c[:3] == ["ip", "link", "add"] and c[3] == topo.shaped_dev]
    assert shaped == [
        ["ip", "link", "add", topo.shaped_dev, "netns", ns["a"], "type", "veth",
         "peer", "name", topo.shaped_dev, "netns", ns["b"]],
    ]  # fmt: skip
    for host in ("a", "b"):
        assert ["ip", "-n", ns[host], "addr", "add", f"{topo.shaped_ip[host]}/24",
                "dev", topo.shaped_dev] in commands  # fmt: skip
        # The coordinator's host reaches a stage's (shaped) address over its control link.
        assert ["ip", "-n", ns["c"], "route", "add", f"{topo.shaped_ip[host]}/32",
                "via", topo.control_ip[host]] in commands  # fmt: skip
    assert topo.shape_commands(Rate.parse("1gbit")) == [
        Rate.parse("1gbit").tc_command(ns[h], topo.shaped_dev) for h in ("a", "b")
    ]
    assert topo.teardown_commands() == [["ip", "netns", "del", n] for n in ns.values()]


def test_rounds_rotate_so_every_run_takes_every_place() -> None:
    orders = [_rotated(RUNS, i) for i in range(len(RUNS))]
    for place in range(len(RUNS)):
        assert {order[place] for order in orders} == set(RUNS)
    assert all(sorted(order) == sorted(RUNS) for order in orders)


def test_ratio_is_the_median_of_each_rounds_own_ratio() -> None:
    def sample(steps_per_s: float) -> Sample:
        return Sample(steps_per_s, wire_bytes=8e6, busiest_bytes=4e6, payload_bytes=None)

    # Round 2 ran while the machine was busy: torch and pipesvc both slow.
    samples = {
        "torch": [sample(10), sample(2), sample(10)],
        "float32": [sample(5), sample(1), sample(6)],
        "bfloat16": [sample(20), sample(4), sample(10)],
    }
    rows = result_rows(Rate.parse("1gbit"), samples)
    assert [r[1] for r in rows] == ["torch (float32)", "pipesvc float32", "pipesvc bfloat16"]
    assert [r[2] for r in rows] == ["10.00", "5.00", "10.00"]
    assert [r[4] for r in rows] == ["1.00", "0.50", "2.00"]
    assert rows[1][5] == "8.00"
    assert rows[1][6] == "n/a"
    # Busier direction: 4 MB/step at 5 steps/s against 125 MB/s.
    assert rows[1][7] == "0.16"
