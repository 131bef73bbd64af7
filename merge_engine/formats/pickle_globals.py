"""The exact (module, name) pairs a checkpoint's pickle may name as an inert record: data, never code.

`merge_engine.formats.safe_unpickler` answers a global on this table with a `Record` class that
only stores the arguments and state the pickle gives it (no function of torch, numpy or argparse runs);
any other global is `UnsafePickle`. The table is exact: no "any name under a module", no dotted name (a
pickle's ``STACK_GLOBAL`` resolves ``a.b`` by walking attributes, which is how a name under an allowed
module reaches ``subprocess.Popen``), and the one attribute step a protocol-2 pickle takes (``getattr`` of
a nested class) is allowed only for the pairs in `NESTED_RECORDS`.

Each class is listed under every module torch 2.x has pickled it from (``torch.distributed._tensor`` before
2.5, ``torch.distributed.tensor`` since). A new torch that moves a class is a new row here, found by a test
failing on a real checkpoint it wrote, never a wider pattern.
"""

from __future__ import annotations

_DTENSOR = {
    "torch.distributed.tensor": ("DTensor",),
    "torch.distributed.tensor._api": ("DTensor",),
    "torch.distributed._tensor.api": ("DTensor",),
    "torch.distributed.tensor.placement_types": ("Shard", "Replicate", "Partial", "_StridedShard", "_Partial",
                                                 "_MaskPartial", "MaskPartial"),
    "torch.distributed._tensor.placement_types": ("Shard", "Replicate", "Partial", "_StridedShard", "_Partial",
                                                  "DTensorSpec", "TensorMeta"),
    "torch.distributed.tensor._dtensor_spec": ("DTensorSpec", "TensorMeta", "ShardOrderEntry"),
    "torch.distributed._tensor._dtensor_spec": ("DTensorSpec", "TensorMeta"),
    "torch.distributed.device_mesh": ("DeviceMesh",),
    "torch.distributed._tensor.device_mesh": ("DeviceMesh",),
    "torch.distributed._mesh_layout": ("_MeshLayout", "_FlatLayout"),
}
_SHARDED_TENSOR = {
    "torch.distributed._shard.sharded_tensor.api": ("ShardedTensor", "ShardedTensorBase"),
    "torch.distributed._shard.sharded_tensor.metadata": ("ShardedTensorMetadata", "TensorProperties",
                                                         "MEM_FORMAT_ENCODING"),
    "torch.distributed._shard.metadata": ("ShardMetadata",),
    "torch.distributed._shard.sharded_tensor.shard": ("Shard",),
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec": ("ChunkShardingSpec",),
    "torch.distributed._shard.sharding_spec.api": ("EnumerableShardingSpec",),
    "torch.distributed.remote_device": ("_remote_device",),
}
_DCP_METADATA = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    # ``StorageMeta.checkpoint_id`` of a `FileSystemWriter` save (Accelerate, torchtitan): the folder as a path
    "pathlib": ("PosixPath", "WindowsPath"),
}
# Megatron-LM pickles its ``args`` (an argparse.Namespace) and numpy RNG state (arrays rebuilt by
# ``_reconstruct``; numpy 2 names a dtype by its class in ``numpy.dtypes``) beside the weights.
_MEGATRON = {
    "argparse": ("Namespace",),
    "numpy": ("ndarray", "dtype"),
    "numpy._core.multiarray": ("_reconstruct",),
    "numpy.core.multiarray": ("_reconstruct",),
    "numpy.dtypes": ("BoolDType", "Int8DType", "ByteDType", "UInt8DType", "UByteDType", "Int16DType", "ShortDType",
                     "UInt16DType", "UShortDType", "Int32DType", "IntDType", "UInt32DType", "UIntDType", "Int64DType",
                     "LongDType", "UInt64DType", "ULongDType", "LongLongDType", "ULongLongDType", "Float16DType",
                     "Float32DType", "Float64DType", "LongDoubleDType", "Complex64DType", "Complex128DType",
                     "CLongDoubleDType", "BytesDType", "StrDType"),
}

# DeepSpeed's ZeRO optimizer files pickle its loss scaler (plain numbers in ``__dict__``) and the ZeRO stage (an
# ``int`` enum, rebuilt from its value)
_DEEPSPEED = {
    "deepspeed.runtime.fp16.loss_scaler": ("LossScaler", "DynamicLossScaler"),
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}

RECORD_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    (module, name) for table in (_DTENSOR, _SHARDED_TENSOR, _DCP_METADATA, _MEGATRON, _DEEPSPEED)
    for module, names in table.items() for name in names)

# (module, qualname of a record class, attribute): the nested classes a protocol-2 pickle reaches by
# ``getattr(<class>, "<name>")``; the result is a record too.
NESTED_RECORDS: frozenset[tuple[str, str, str]] = frozenset({
    ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor", "ProcessGroupState"),
})


def is_plain_name(name: str) -> bool:
    """Whether ``name`` is one identifier: a dotted name (an attribute walk) is never a global we answer."""
    return isinstance(name, str) and name.isidentifier()
