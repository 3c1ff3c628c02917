from pipesvc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_MODE_UNSPECIFIED: _ClassVar[RunMode]
    TRAIN: _ClassVar[RunMode]
    INFER: _ClassVar[RunMode]

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    ACTIVATION: _ClassVar[Direction]
    GRADIENT: _ClassVar[Direction]
RUN_MODE_UNSPECIFIED: RunMode
TRAIN: RunMode
INFER: RunMode
DIRECTION_UNSPECIFIED: Direction
ACTIVATION: Direction
GRADIENT: Direction

class DescribeRequest(_message.Message):
    __slots__ = ("model", "model_args_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_args_json: str
    def __init__(self, model: _Optional[str] = ..., model_args_json: _Optional[str] = ...) -> None: ...

class TensorDescription(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class LayerDescription(_message.Message):
    __slots__ = ("index", "num_parameters", "parameter_bytes", "tensors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_parameters: int
    parameter_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDescription]
    def __init__(self, index: _Optional[int] = ..., num_parameters: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorDescription, _Mapping]]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerDescription]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerDescription, _Mapping]]] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "spec", "stage", "num_stages", "downstream_address")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    spec: _common_pb2.JobSpec
    stage: _common_pb2.PlanStage
    num_stages: int
    downstream_address: str
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., stage: _Optional[_Union[_common_pb2.PlanStage, _Mapping]] = ..., num_stages: _Optional[int] = ..., downstream_address: _Optional[str] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("num_parameters",)
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    num_parameters: int
    def __init__(self, num_parameters: _Optional[int] = ...) -> None: ...

class RunStepRequest(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "run_id", "mode", "num_microbatches", "inputs", "targets", "loss_weights")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    LOSS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    run_id: int
    mode: RunMode
    num_microbatches: int
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    targets: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    loss_weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., run_id: _Optional[int] = ..., mode: _Optional[_Union[RunMode, str]] = ..., num_microbatches: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., targets: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., loss_weights: _Optional[_Iterable[float]] = ...) -> None: ...

class RunStepResponse(_message.Message):
    __slots__ = ("losses", "outputs", "grad_norm_sq", "max_live_activations")
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_SQ_FIELD_NUMBER: _ClassVar[int]
    MAX_LIVE_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    losses: _containers.RepeatedScalarFieldContainer[float]
    outputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    grad_norm_sq: float
    max_live_activations: int
    def __init__(self, losses: _Optional[_Iterable[float]] = ..., outputs: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., grad_norm_sq: _Optional[float] = ..., max_live_activations: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "run_id", "grad_scale")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    run_id: int
    grad_scale: float
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., run_id: _Optional[int] = ..., grad_scale: _Optional[float] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "run_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    run_id: int
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., run_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("job_id", "kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    kind: _common_pb2.StateKind
    def __init__(self, job_id: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.StateKind, str]] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("job_id", "frame")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    frame: _common_pb2.TensorFrame
    def __init__(self, job_id: _Optional[str] = ..., frame: _Optional[_Union[_common_pb2.TensorFrame, _Mapping]] = ...) -> None: ...

class LoadStateResponse(_message.Message):
    __slots__ = ("num_tensors",)
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    def __init__(self, num_tensors: _Optional[int] = ...) -> None: ...

class ApplyStateRequest(_message.Message):
    __slots__ = ("job_id", "apply")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    apply: bool
    def __init__(self, job_id: _Optional[str] = ..., apply: _Optional[bool] = ...) -> None: ...

class ApplyStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("address", "device", "memory_bytes", "models", "job_id", "start_layer", "end_layer", "rank", "parameter_names", "num_parameters", "step", "num_threads")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_NAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    memory_bytes: int
    models: _containers.RepeatedScalarFieldContainer[str]
    job_id: str
    start_layer: int
    end_layer: int
    rank: int
    parameter_names: _containers.RepeatedScalarFieldContainer[str]
    num_parameters: int
    step: int
    num_threads: int
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., job_id: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., rank: _Optional[int] = ..., parameter_names: _Optional[_Iterable[str]] = ..., num_parameters: _Optional[int] = ..., step: _Optional[int] = ..., num_threads: _Optional[int] = ...) -> None: ...

class MicrobatchId(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "run_id", "microbatch_index", "direction")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    run_id: int
    microbatch_index: int
    direction: Direction
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., run_id: _Optional[int] = ..., microbatch_index: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ...) -> None: ...

class DataFrame(_message.Message):
    __slots__ = ("id", "header", "frame_index", "data")
    ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    id: MicrobatchId
    header: _common_pb2.TensorHeader
    frame_index: int
    data: bytes
    def __init__(self, id: _Optional[_Union[MicrobatchId, _Mapping]] = ..., header: _Optional[_Union[_common_pb2.TensorHeader, _Mapping]] = ..., frame_index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
