"""Unit tests for pipesvc.core.health: the names on the wire and in output stay plain strings."""

from __future__ import annotations

import json

import pytest
from grpc_health.v1 import health_pb2

from pipesvc.core.health import Health


@pytest.mark.parametrize("health", list(Health), ids=str)
def test_each_member_round_trips_through_its_wire_name(health: Health) -> None:
    assert Health.from_wire(str(health)) is health
    assert health == health.name
    assert f"{health}" == health.name
    assert f"{health:<12}|" == f"{health.name:<12}|"
    assert json.dumps({"health": health}) == json.dumps({"health": health.name})


def test_every_grpc_serving_status_has_a_member() -> None:
    names = health_pb2.HealthCheckResponse.ServingStatus.keys()
    assert {Health.from_wire(name).name for name in names} == set(names)


def test_a_name_this_version_does_not_know_reads_as_unknown() -> None:
    assert Health.from_wire("DRAINING") is Health.UNKNOWN
    assert Health.from_wire("") is Health.UNKNOWN
    assert Health.from_wire("serving") is Health.UNKNOWN
