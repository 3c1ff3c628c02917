"""Shared real cluster for integration tests: one coordinator and four stage processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import pipesvc

NUM_STAGES = 4


@pytest.fixture(scope="session")
def cluster() -> Iterator[pipesvc.LocalCluster]:
    with pipesvc.LocalCluster(num_stages=NUM_STAGES, threads_per_stage=1) as running:
        yield running


@pytest.fixture(scope="session")
def client(cluster: pipesvc.LocalCluster) -> Iterator[pipesvc.Client]:
    with pipesvc.connect(cluster.address, timeout_s=120) as connected:
        yield connected
