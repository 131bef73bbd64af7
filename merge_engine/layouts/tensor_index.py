"""A checked checkpoint's parsed tensor index, carried in `Checkpoint.index` so that nothing is parsed twice.

A layout's deep check reads every rank file's header (the zip directory and the pickle of a
``torch.save`` file) and builds from them the table `open` serves: canonical name -> lazy tensor
(`merge_engine.formats.tensor_source.Assembly`, pieces pointing into their files). `carry` pickles that table
with its file handles; `restore` gives a fresh copy of both, in this process or in any other the
checkpoint travels to (a Prefect task, a Ray worker), and reads nothing: a restored handle holds its
file's zip directory and opens its reader pinned to the size and version the check listed
(`merge_engine.storage.RangeReader.listed`), so a file changed since the check gives `SourceChanged`
naming it at its first read, never bytes of another version.

Bounded: an index whose pickle is over `MAX_INDEX_BYTES` is not carried (`carry` returns None) and
`open` reads the headers again, as a checkpoint without an index does; what is carried is that pickle
compressed (zlib: ~2 KB for a 2-rank test model, ~27 KB for a 4-rank 0.5B one, about 1/5 to 1/8), and
`restore` never inflates more than the bound. Every byte of the index comes from this engine (the check
of this run, or Prefect's result storage of it), and `restore` still unpickles it through an allow-list:
the engine's own record classes (classes only: no engine function can be named), nothing else: the records
hold dtypes by name (`merge_engine.formats.dtype_names`), so neither carrying nor restoring an index imports torch.
"""

from __future__ import annotations

import io
import pickle
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

# the records' shape: bump it whenever a class an index holds changes its fields (an index of another shape,
# from Prefect's result storage of an older engine, is then not read: `restore` gives None)
INDEX_FORMAT = 2
MAX_INDEX_BYTES = 64 << 20  # the pickle, before compression: ~200k tensor pieces (hundreds of rank files)
_MODULES = ("merge_engine.",)  # the engine's records: lazy tensors, their pieces, file handles


def carry(tensors: Mapping[str, Any], handles: Sequence[Any]) -> bytes | None:
    """The index of ``tensors`` (name -> lazy tensor) over the file ``handles`` they point into, as compressed
    bytes; None when its pickle is over `MAX_INDEX_BYTES` (not carried)."""
    data = pickle.dumps((dict(tensors), tuple(handles)), protocol=pickle.HIGHEST_PROTOCOL)
    return _tag() + zlib.compress(data) if len(data) <= MAX_INDEX_BYTES else None


def _tag() -> bytes:
    from merge_engine import __version__

    return f"stepmerge {__version__} tensor index {INDEX_FORMAT}\n".encode()


def restore(index: bytes) -> tuple[dict[str, Any], list[Any]] | None:
    """A fresh copy of a carried index: (name -> lazy tensor, the file handles they read through); None for an
    index another engine version or record shape carried (the caller reads the headers again)."""
    tag = _tag()
    if not index.startswith(tag):
        return None
    inflate = zlib.decompressobj()
    data = inflate.decompress(index[len(tag):], MAX_INDEX_BYTES)
    if inflate.unconsumed_tail or not inflate.eof:
        raise pickle.UnpicklingError(f"a carried tensor index inflates past {MAX_INDEX_BYTES} bytes, or is cut short")
    tensors, handles = _IndexUnpickler(io.BytesIO(data)).load()
    return tensors, list(handles)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_MODULES):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a record class; never a function a forged index could call
                return found
        raise pickle.UnpicklingError(f"a carried tensor index names {module}.{name}: not one of the engine's records")
