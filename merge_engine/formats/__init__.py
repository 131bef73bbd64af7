"""Byte formats, read lazily and safely over any storage URL; no knowledge of trainers or models.

- `torch_archive`     ``torch.save`` zip archives: structure first, bytes on demand
- `safe_unpickler`    the allow-list unpickler: a pickle's globals answered by inert stand-ins, nothing run
- `pickle_globals`    the exact (module, name) pairs a pickle may name as an inert record
- `stored_tensor`     a tensor as a file stores it (`StoredTensor`: a view on a storage record, no data)
- `zip_crc`           CRC-32 of zip records checked as they are read, in pieces of any size and order
- `dtype_names`       dtypes by name and item size, without torch (a check reads headers only)
- `dcp_index`         a torch.distributed.checkpoint folder's ``.metadata``, parsed safely and checked (tiling)
- `torch_dcp`         torch.distributed.checkpoint folders read without a process group
- `torch_dcp_writer`  torch.distributed.checkpoint folders written without a process group
- `dcp_file_names`    the file names DCP writes, for listings
- `safetensors_file`  safetensors: header first, tensor bytes by ranged reads
- `json_file`         small JSON metadata files read from a folder URL
- `hf_metadata`       a Hugging Face folder's non-weight files: config, generation config, tokenizer
- `tensor_source`     `TensorSource`, the lazy view every layout gives of a checkpoint
- `chunks`            flat chunk streams: tensors cut into bounded pieces and re-cut together
"""
