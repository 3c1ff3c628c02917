"""A job's start on the coordinator: planned and assigned anew (``create_job``), or read back
after a restart (``reopen_job``)."""

from __future__ import annotations

import logging

from pipesvc.coordinator import planner
from pipesvc.coordinator.database import JobRecord
from pipesvc.coordinator.job import JobDriver
from pipesvc.coordinator.job_storage import JobStorage
from pipesvc.coordinator.replicas import Rendezvous
from pipesvc.coordinator.stage_calls import Deadlines
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.core.config import JobConfig, config_from_dict
from pipesvc.core.plan import plan_from_dicts
from pipesvc.errors import PipesvcError
from pipesvc.observe.metrics import NO_METRICS, Metrics
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)


def create_job(
    job_id: str,
    config: JobConfig,
    registry: StageRegistry,
    deadlines: Deadlines,
    storage: JobStorage,
    metrics: Metrics = NO_METRICS,
    rendezvous: Rendezvous | None = None,
) -> JobDriver:
    """Plans ``config`` onto free stages and assigns each its layers.

    Raises:
        UnknownModelError: no registered stage can build the model.
        InvalidArgumentError: more stages than layers, or bad model arguments.
        PlanError: fewer free stages than ``num_stages``.
    """
    layers = planner.describe(registry, config, deadlines.control_s)
    plan = planner.plan_job(registry, config, layers, job_id)
    planner.place(registry, plan)
    driver = JobDriver(
        job_id=job_id,
        config=config,
        layers=layers,
        plan=plan,
        registry=registry,
        deadlines=deadlines,
        storage=storage,
        metrics=metrics,
        rendezvous=rendezvous,
    )
    try:
        driver.group.assign()
    except PipesvcError:
        driver.close()
        raise
    driver.ledger.persist()
    logger.info("job %s: planned %s over %s", job_id, config.model, driver.group.describe())
    return driver


def reopen_job(
    record: JobRecord,
    registry: StageRegistry,
    deadlines: Deadlines,
    storage: JobStorage,
    metrics: Metrics = NO_METRICS,
    rendezvous: Rendezvous | None = None,
) -> JobDriver:
    """A job read back after a coordinator restart; it reconciles with its stages first."""
    layers = list(stage_pb2.DescribeResponse.FromString(record.layers).layers)
    plan = plan_from_dicts(record.plan)
    return JobDriver(
        job_id=record.job_id,
        config=config_from_dict(record.spec),
        layers=layers,
        plan=plan,
        registry=registry,
        deadlines=deadlines,
        storage=storage,
        epoch=record.epoch,
        record=record,
        needs_reconcile=True,
        metrics=metrics,
        rendezvous=rendezvous,
    )
