from pipesvc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterStageRequest(_message.Message):
    __slots__ = ("address", "device", "memory_bytes", "models")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    memory_bytes: int
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterStageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListStagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("address", "device", "memory_bytes", "models", "job_id", "start_layer", "end_layer", "rank", "health")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    memory_bytes: int
    models: _containers.RepeatedScalarFieldContainer[str]
    job_id: str
    start_layer: int
    end_layer: int
    rank: int
    health: str
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., job_id: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., rank: _Optional[int] = ..., health: _Optional[str] = ...) -> None: ...

class ListStagesResponse(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    def __init__(self, stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.JobSpec
    def __init__(self, spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "spec", "plan_epoch", "plan", "step", "num_layers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: _common_pb2.JobSpec
    plan_epoch: int
    plan: _containers.RepeatedCompositeFieldContainer[_common_pb2.PlanStage]
    step: int
    num_layers: int
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., plan_epoch: _Optional[int] = ..., plan: _Optional[_Iterable[_Union[_common_pb2.PlanStage, _Mapping]]] = ..., step: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("job_id", "inputs", "targets")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    inputs: _common_pb2.Tensor
    targets: _common_pb2.Tensor
    def __init__(self, job_id: _Optional[str] = ..., inputs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., targets: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("loss", "step")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    loss: float
    step: int
    def __init__(self, loss: _Optional[float] = ..., step: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("job_id", "inputs")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    inputs: _common_pb2.Tensor
    def __init__(self, job_id: _Optional[str] = ..., inputs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _common_pb2.Tensor
    def __init__(self, outputs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class GetJobStateRequest(_message.Message):
    __slots__ = ("job_id", "kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    kind: _common_pb2.StateKind
    def __init__(self, job_id: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.StateKind, str]] = ...) -> None: ...

class LoadJobStateRequest(_message.Message):
    __slots__ = ("job_id", "frame")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    frame: _common_pb2.TensorFrame
    def __init__(self, job_id: _Optional[str] = ..., frame: _Optional[_Union[_common_pb2.TensorFrame, _Mapping]] = ...) -> None: ...

class LoadJobStateResponse(_message.Message):
    __slots__ = ("num_tensors",)
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    def __init__(self, num_tensors: _Optional[int] = ...) -> None: ...

class CloseJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CloseJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
