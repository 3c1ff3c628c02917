from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class StateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_KIND_UNSPECIFIED: _ClassVar[StateKind]
    PARAMETERS: _ClassVar[StateKind]
    GRADIENTS: _ClassVar[StateKind]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
INT16: DType
INT8: DType
UINT8: DType
BOOL: DType
STATE_KIND_UNSPECIFIED: StateKind
PARAMETERS: StateKind
GRADIENTS: StateKind

class TensorHeader(_message.Message):
    __slots__ = ("dtype", "shape", "num_bytes", "num_frames")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    num_frames: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., num_frames: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("name", "header", "frame_index", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    header: TensorHeader
    frame_index: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., header: _Optional[_Union[TensorHeader, _Mapping]] = ..., frame_index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("model", "model_args_json", "seed", "num_stages", "num_microbatches", "schedule", "optimizer_json", "loss", "partition", "clip_grad_norm")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    CLIP_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_args_json: str
    seed: int
    num_stages: int
    num_microbatches: int
    schedule: str
    optimizer_json: str
    loss: str
    partition: str
    clip_grad_norm: float
    def __init__(self, model: _Optional[str] = ..., model_args_json: _Optional[str] = ..., seed: _Optional[int] = ..., num_stages: _Optional[int] = ..., num_microbatches: _Optional[int] = ..., schedule: _Optional[str] = ..., optimizer_json: _Optional[str] = ..., loss: _Optional[str] = ..., partition: _Optional[str] = ..., clip_grad_norm: _Optional[float] = ...) -> None: ...

class PlanStage(_message.Message):
    __slots__ = ("start_layer", "end_layer", "rank", "address")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    rank: int
    address: str
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., rank: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...
