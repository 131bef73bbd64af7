"""The jobs of a torchtitan checkpoint (`merge_engine.layouts.torchtitan`, its ``JOBS``): torchtitan's own names
renamed to the Hub's by the family table (`merge_engine.architectures.torchtitan`) of the config the user names
(torchtitan saves none), the projections torchtitan keeps in its RoPE row order permuted as its adapter's ``to_hf``
does. A family without a table, or a tensor its table does not name, is `UnsupportedLayout` naming the layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from merge_engine.architectures.torchtitan import TABLES, hub_name, rope_heads
from merge_engine.errors import InvalidOption, UnsupportedLayout
from merge_engine.formats.hf_metadata import read_config
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, AssembledSource
from merge_engine.layouts import Checkpoint

if TYPE_CHECKING:
    import torch

    from merge_engine.commands.input_folders import InputFolders
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.output.jobs import OutputOptions, PreparedJob

LAYOUT = "torchtitan"


def _config_folder(checkpoint: Checkpoint, options: OutputOptions) -> str:
    folder = options.hf_model_path or checkpoint.hf_dir
    if folder is None:
        raise InvalidOption("torchtitan saves no config.json: pass --hf_model_path (a folder with the model's "
                            "config.json)", checkpoint.url)
    return folder


def step_config(checkpoint: Checkpoint, options: OutputOptions, inputs: InputFolders) -> tuple[dict[str, Any], str]:
    """The config.json ``--hf_model_path`` names (else one saved beside the weights) and its folder."""
    folder = _config_folder(checkpoint, options)
    return inputs.config(folder, "checkpoint"), folder


def prepare_merge(checkpoint: Checkpoint, options: OutputOptions, source_url: str,
                  inputs: InputFolders) -> PreparedJob | None:
    return None  # planned like any checkpoint, from `merge_source`


class RopeRowsToHub:
    """A torchtitan projection in the Hub's row order: each head's rows ``(head_dim // 2, 2)`` transposed to
    ``(2, head_dim // 2)`` (torchtitan's ``to_hf``), one head read at a time."""

    def __init__(self, inner: Any, heads: int, url: str) -> None:
        rows = inner.shape[0] if inner.shape else 0
        if len(inner.shape) != 2 or heads < 1 or rows % heads or (rows // heads) % 2:
            raise UnsupportedLayout(f"{LAYOUT}: {inner.key!r} {list(inner.shape)} is not {heads} heads of an even "
                                    "head size", url)
        self.inner, self.heads, self.head_rows = inner, heads, rows // heads

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inner.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def dtype_name(self) -> str:
        return self.inner.dtype_name

    def _head(self, head: int) -> torch.Tensor:
        cols = self.inner.shape[1]
        block = self.inner.read_box((head * self.head_rows, 0), (self.head_rows, cols))
        return block.view(self.head_rows // 2, 2, cols).transpose(0, 1).reshape(self.head_rows, cols)

    def iter_chunks(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        for head in range(self.heads):
            yield self._head(head).reshape(-1)

    def read(self) -> torch.Tensor:
        import torch

        return torch.cat([self._head(head) for head in range(self.heads)])


def merge_source(checkpoint: Checkpoint, source: TensorSource, options: OutputOptions) -> TensorSource:
    """``source`` (torchtitan's names) under the Hub's names of the config's family."""
    config = read_config(_config_folder(checkpoint, options))
    model_type = config.get("model_type")
    table = TABLES.get(model_type) if isinstance(model_type, str) else None
    if table is None:
        raise UnsupportedLayout(f"{LAYOUT}: no name table for model_type {model_type!r} (torchtitan's state-dict "
                                f"adapters read here: {', '.join(sorted(TABLES))})", checkpoint.url)
    if not isinstance(source, AssembledSource):
        raise TypeError("a torchtitan checkpoint opens as an AssembledSource")
    renamed: dict[str, Any] = {}
    for name in source.metas():
        hub = hub_name(name, table)
        if hub is None:
            raise UnsupportedLayout(f"{LAYOUT}: the {model_type} table has no Hub name for {name!r}", checkpoint.url)
        if hub in renamed:
            raise UnsupportedLayout(f"{LAYOUT}: two tensors give {hub!r} (e.g. {name!r})", checkpoint.url)
        assembly = source.assembly(name)
        heads_key = rope_heads(hub, table)
        if heads_key is not None:
            heads = config.get(heads_key) or config.get("num_attention_heads")
            if not isinstance(heads, int):
                raise UnsupportedLayout(f"{LAYOUT}: config.json gives no {heads_key} for {hub!r}", checkpoint.url)
            assembly = RopeRowsToHub(assembly, heads, checkpoint.url)
        renamed[hub] = assembly
    return AssembledSource(checkpoint.url, renamed, [source])


def prepare_extract(checkpoint: Checkpoint, options: OutputOptions, source_url: str, published_url: str | None,
                    inputs: InputFolders) -> PreparedJob:
    raise UnsupportedLayout(f"{LAYOUT}: a torchtitan checkpoint holds no LoRA adapter to extract", checkpoint.url)
