"""Wire fuzzing: random and mutated well-formed requests to every RPC of both services.

Each example sends one request (or one short stream) to a real cluster of its own, holding one
real job, and then checks the properties every server keeps whatever it is sent: the answer
is OK or a typed status (never UNKNOWN) and comes before the deadline (no hang); every server
still answers its health check with SERVING (no crash); and
the real job is as it was (same plan, step and weights: bad input changes nothing). The last
test trains the real job one step and compares it with the one-process reference, so a
fuzzer that broke the job in a way these checks miss is caught there.

Requests are bytes on the wire (serialised here, sometimes mutated), so the servers' own
deserialisation is fuzzed too. See ``fuzz_messages`` for what is generated and which valid
changes of the real job are kept out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import pipesvc
from pipesvc.core.tensor_codec import named_frames
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from pipesvc.wire.rpc_status import ERROR_CLASS_KEY
from tests.support.fuzz_messages import (
    COORDINATOR_RPCS,
    STAGE_RPCS,
    Rpc,
    Target,
    make_safe,
    mutated,
    parse_all,
    requests,
    sometimes,
)
from tests.support.reference import PROBLEMS, Reference

pytestmark = pytest.mark.filterwarnings(
    # On a failure hypothesis imports libcst to suggest a patch; this libcst warns on import,
    # and the warning (an error here) would replace the test's own report.
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)

MLP = PROBLEMS["mlp"]
OPTIMIZER = {"name": "sgd", "lr": 0.1}
SEED = 0
CALL_TIMEOUT_S = 5.0
"""Deadline of each fuzzed call: every answer is an error or small, so this is a hang."""
HEALTH_TIMEOUT_S = 1.0
RECV_TIMEOUT_S = 3
"""Stages give up on a missing activation or gradient after this, so an example that breaks
the data plane fails in seconds (the probe inference waits this long), not minutes."""

FUZZ_SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
UNARY_COORDINATOR_RPCS = [r for r in COORDINATOR_RPCS if not r.request_streaming]
UNARY_STAGE_RPCS = [r for r in STAGE_RPCS if not r.request_streaming]
STATE_RPCS = [
    r for r in COORDINATOR_RPCS + STAGE_RPCS if r.request_streaming and not r.response_streaming
]
DATA_RPCS = [r for r in STAGE_RPCS if r.request_streaming and r.response_streaming]
TRAIN_RPCS = [r for r in COORDINATOR_RPCS if r.request_streaming and r.response_streaming]
STREAM_SETTINGS = settings(FUZZ_SETTINGS, max_examples=80)
"""Request streams carry the most validation (framing, routing, all-or-nothing), so more."""


class Harness:
    """The fuzzed cluster, its real job, and raw channels to every server."""

    def __init__(
        self,
        *,
        cluster: pipesvc.LocalCluster,
        job: pipesvc.Job,
        target: Target,
        reference: Reference,
        probe: torch.Tensor,
        channels: dict[str, grpc.Channel],
    ) -> None:
        self.cluster = cluster
        self.job = job
        self.target = target
        self.reference = reference
        self.initial = target.state
        self.probe = probe
        """A batch the job runs after every example ..."""
        with torch.no_grad():
            self.probe_output = reference.model(probe)
        """... and the reference model's output for it."""
        self.channels = channels

    def __repr__(self) -> str:  # hypothesis prints it with each failing example
        return f"Harness(job={self.target.job_id!r}, plan_epoch={self.target.plan_epoch})"

    def coordinator(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        return coordinator_pb2_grpc.CoordinatorServiceStub(self.channels[self.target.coordinator])

    def stage(self, address: str) -> stage_pb2_grpc.StageServiceStub:
        return stage_pb2_grpc.StageServiceStub(self.channels[address])

    def restore(self) -> None:
        """Loads the initial weights and step 0 into the job, undoing what the fuzzer did."""

        def requests() -> Iterator[coordinator_pb2.LoadJobStateRequest]:
            for name, tensor in self.initial.items():
                for frame in named_frames(name, tensor):
                    job_id = self.target.job_id
                    yield coordinator_pb2.LoadJobStateRequest(job_id=job_id, frame=frame)

        first, *rest = requests()
        first.step = 0
        self.coordinator().LoadState(iter([first, *rest]), timeout=60)

    def job_info(self) -> coordinator_pb2.JobInfo:
        request = coordinator_pb2.GetJobRequest(job_id=self.target.job_id)
        return self.coordinator().GetJob(request, timeout=CALL_TIMEOUT_S)


@pytest.fixture(scope="module")
def fuzz() -> Iterator[Harness]:
    # A cluster of its own: fuzzing must not disturb the shared one.
    with (
        pipesvc.LocalCluster(
            num_stages=2,
            threads_per_stage=1,
            stage_args=["--recv-timeout-s", str(RECV_TIMEOUT_S)],
        ) as cluster,
        cluster.connect(timeout_s=60) as client,
    ):
        job = client.create_job(
            model=MLP.model,
            model_args=MLP.model_args,
            seed=SEED,
            num_stages=2,
            num_microbatches=4,
            loss=MLP.loss,
            optimizer=OPTIMIZER,
        )
        reference = Reference(MLP, seed=SEED, optimizer=OPTIMIZER, clip_grad_norm=None)
        initial = job.state_dict()
        expected = reference.model.state_dict()
        assert initial.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(initial[key], value, rtol=0, atol=0)
        target = Target(
            job_id=job.id,
            plan_epoch=1,
            coordinator=cluster.address,
            stages=tuple(s.address for s in job.plan),
            state=initial,
            in_features=MLP.model_args["in_features"],
            hidden_features=MLP.model_args["hidden_features"],
            out_features=MLP.model_args["out_features"],
        )
        channels = {a: grpc.insecure_channel(a) for a in (cluster.address, *target.stages)}
        try:
            harness = Harness(
                cluster=cluster,
                job=job,
                target=target,
                reference=reference,
                probe=MLP.batch(8, seed=0)[0],
                channels=channels,
            )
            assert harness.job_info().plan_epoch == target.plan_epoch
            # One inference, as for a job in use: the stages' data stream is open while fuzzing.
            torch.testing.assert_close(job.forward(harness.probe), harness.probe_output)
            yield harness
        finally:
            for channel in channels.values():
                channel.close()


# -- one call, and the properties checked after it ---------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    error_class: str
    responses: list[bytes]


def invoke(channel: grpc.Channel, rpc: Rpc, payloads: list[bytes]) -> Outcome:
    """Sends raw request bytes (no client-side serialisation) and drains the answer."""
    try:
        if rpc.request_streaming and rpc.response_streaming:
            call = channel.stream_stream(rpc.path)
            responses = list(call(iter(payloads), timeout=CALL_TIMEOUT_S))
        elif rpc.request_streaming:
            call = channel.stream_unary(rpc.path)
            responses = [call(iter(payloads), timeout=CALL_TIMEOUT_S)]
        elif rpc.response_streaming:
            call = channel.unary_stream(rpc.path)
            responses = list(call(payloads[0], timeout=CALL_TIMEOUT_S))
        else:
            call = channel.unary_unary(rpc.path)
            responses = [call(payloads[0], timeout=CALL_TIMEOUT_S)]
    except grpc.RpcError as exc:
        error_class = ""
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_CLASS_KEY:
                error_class = str(value)
        return Outcome(exc.code(), exc.details() or "", error_class, [])
    return Outcome(grpc.StatusCode.OK, "", "", responses)


def check_answer(rpc: Rpc, outcome: Outcome) -> None:
    what = f"{rpc.id} answered {outcome.code.name} ({outcome.error_class}): {outcome.details}"
    note(what)
    assert outcome.code != grpc.StatusCode.UNKNOWN, what
    # A deadline the server raised names its error class; the caller's own deadline does not.
    hung = outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED and not outcome.error_class
    assert not hung, f"{rpc.id} did not answer within {CALL_TIMEOUT_S} s"
    for response in outcome.responses:
        rpc.response_class.FromString(response)


def check_healthy(fuzz: Harness) -> None:
    for address, channel in fuzz.channels.items():
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise AssertionError(f"health of {address} failed: {exc}") from exc
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, address


def check_job_unchanged(fuzz: Harness, before: coordinator_pb2.JobInfo) -> None:
    """The real job still runs correctly, with the plan, step and weights it had before.

    A rebuild (new plan epoch, a recovery) counts as a change: the fuzzer's requests are junk
    and must not make the job lose a stage. What can be repaired is repaired before failing
    (weights reloaded, the fuzzer's view of the epoch updated), so that a failure stays with
    the example that caused it.
    """
    t = fuzz.target
    problems = []
    try:
        output = fuzz.job.forward(fuzz.probe)
    except pipesvc.PipesvcError as exc:
        problems.append(f"the job's inference failed: {type(exc).__name__}: {exc}")
    else:
        if not torch.allclose(output, fuzz.probe_output, rtol=1e-5, atol=1e-6):
            problems.append("the job's inference differs from the reference")
    after = fuzz.job_info()
    if after.plan_epoch != t.plan_epoch:
        fuzz.target = dataclasses.replace(t, plan_epoch=after.plan_epoch)
    if (after.plan_epoch, after.recoveries) != (before.plan_epoch, before.recoveries):
        problems.append(
            f"the coordinator rebuilt the job during this example (plan epoch "
            f"{before.plan_epoch} -> {after.plan_epoch}, recoveries {before.recoveries} -> "
            f"{after.recoveries})"
        )
    if after.step != 0 or tuple(s.address for s in after.plan) != t.stages:
        problems.append(f"the job is at step {after.step} on {[s.address for s in after.plan]}")
    for address in t.stages:
        held = fuzz.stage(address).Info(stage_pb2.InfoRequest(), timeout=CALL_TIMEOUT_S)
        if (held.job_id, held.step, held.plan_epoch) != (t.job_id, 0, after.plan_epoch):
            problems.append(
                f"stage {address} holds job {held.job_id!r} at step {held.step}, "
                f"epoch {held.plan_epoch}"
            )
    state = fuzz.job.state_dict()
    changed = sorted(
        k for k, v in fuzz.initial.items() if k not in state or not torch.equal(state[k], v)
    )
    if changed or state.keys() != fuzz.initial.keys():
        problems.append(f"the job's weights changed: {changed or sorted(state)}")
    if problems:
        fuzz.restore()
    assert not problems, "; ".join(problems)


def fuzz_one(fuzz: Harness, rpc: Rpc, data: st.DataObject, address: str = "") -> None:
    t = fuzz.target
    before = fuzz.job_info()
    messages = data.draw(requests(rpc, t), label="requests")
    payloads = [m.SerializeToString() for m in messages]
    if payloads and data.draw(sometimes(5), label="mutate"):
        index = data.draw(st.integers(0, len(payloads) - 1), label="mutated message")
        payloads[index] = data.draw(mutated(payloads[index]), label="mutated payload")
    payloads = make_safe(rpc, payloads, t)
    if not address and rpc.service.endswith("StageService"):
        address = data.draw(st.sampled_from(t.stages), label="stage")
    address = address or t.coordinator
    channel = fuzz.channels[address]
    if rpc.id == "stage.ApplyState":
        # Applying what the fuzzer staged earlier could be a valid state change: drop it first,
        # so that apply=True meets an empty staging area and must be refused.
        for request in parse_all(rpc, payloads):
            if request is not None and request.job_id == t.job_id and request.apply:
                drop = stage_pb2.ApplyStateRequest(job_id=t.job_id, apply=False)
                fuzz.stage(address).ApplyState(drop, timeout=CALL_TIMEOUT_S)
    outcome = invoke(channel, rpc, payloads)
    check_answer(rpc, outcome)
    check_healthy(fuzz)
    check_job_unchanged(fuzz, before)


# -- the tests, in order: unary calls, state and training streams, data streams, a real step ----


@pytest.mark.parametrize("rpc", UNARY_COORDINATOR_RPCS, ids=lambda r: r.id)
@FUZZ_SETTINGS
@given(data=st.data())
def test_coordinator_survives_fuzzed_requests(fuzz: Harness, rpc: Rpc, data: st.DataObject) -> None:
    fuzz_one(fuzz, rpc, data)


@pytest.mark.parametrize("rpc", UNARY_STAGE_RPCS, ids=lambda r: r.id)
@FUZZ_SETTINGS
@given(data=st.data())
def test_stage_survives_fuzzed_control_requests(
    fuzz: Harness, rpc: Rpc, data: st.DataObject
) -> None:
    fuzz_one(fuzz, rpc, data)


@pytest.mark.parametrize("rpc", STATE_RPCS, ids=lambda r: r.id)
@STREAM_SETTINGS
@given(data=st.data())
def test_servers_survive_fuzzed_state_streams(fuzz: Harness, rpc: Rpc, data: st.DataObject) -> None:
    fuzz_one(fuzz, rpc, data)


@pytest.mark.parametrize("rpc", TRAIN_RPCS, ids=lambda r: r.id)
@STREAM_SETTINGS
@given(data=st.data())
def test_coordinator_survives_fuzzed_training_streams(
    fuzz: Harness, rpc: Rpc, data: st.DataObject
) -> None:
    fuzz_one(fuzz, rpc, data)


@pytest.mark.parametrize("rank", [0, 1], ids=["first-stage", "last-stage"])
@pytest.mark.parametrize("rpc", DATA_RPCS, ids=lambda r: r.id)
@STREAM_SETTINGS
@given(data=st.data())
def test_stage_survives_fuzzed_data_streams(
    fuzz: Harness, rpc: Rpc, rank: int, data: st.DataObject
) -> None:
    # The first stage has no upstream neighbour; the last one's stream from it is open.
    fuzz_one(fuzz, rpc, data, fuzz.target.stages[rank])


@pytest.mark.parametrize(
    ("servicer", "fuzzed"),
    [
        (
            coordinator_pb2_grpc.CoordinatorServiceServicer,
            UNARY_COORDINATOR_RPCS + STATE_RPCS + TRAIN_RPCS,
        ),
        (stage_pb2_grpc.StageServiceServicer, UNARY_STAGE_RPCS + STATE_RPCS + DATA_RPCS),
    ],
)
def test_every_rpc_is_fuzzed(servicer: type, fuzzed: list[Rpc]) -> None:
    service = servicer.__name__.removesuffix("Servicer")
    methods = {name for name in vars(servicer) if not name.startswith("_")}
    assert {r.method.name for r in fuzzed if r.service.endswith(service)} == methods


def test_real_job_trains_correctly_after_fuzzing(fuzz: Harness) -> None:
    state = fuzz.job.state_dict()
    for key, value in fuzz.reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    x, y = MLP.batch(8, seed=1)
    loss = fuzz.job.train_step(x, y)
    expected_loss = fuzz.reference.step(x, y)
    assert loss == pytest.approx(expected_loss, rel=1e-4, abs=1e-5)
    state = fuzz.job.state_dict()
    for key, value in fuzz.reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5)
