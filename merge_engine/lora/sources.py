"""Views over `TensorSource`s that the adapter paths need: renamed, and several seen as one.

- `RenamedSource(source, names)`: ``names`` maps a new name to the source's name; only those
  names exist (a PEFT checkpoint seen under Hugging Face names).
- `NamespacedSource({"base": a, "adapter0": b})`: every tensor as ``"<namespace>::<name>"``, so one
  plan can read a base model and its adapters together.
Both stream exactly what the wrapped source streams; closing closes the wrapped sources.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorMeta, TensorSource

SEPARATOR = "::"


class RenamedSource:
    def __init__(self, source: TensorSource, names: Mapping[str, str]) -> None:
        self.url = source.url
        self._source = source
        self._names = dict(names)
        metas = source.metas()
        self._metas = {new: TensorMeta(new, metas[old].shape, metas[old].dtype) for new, old in self._names.items()}

    def metas(self) -> Mapping[str, TensorMeta]:
        return self._metas

    def original(self, name: str) -> str:
        return self._names[name]

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        return self._source.iter_chunks(self._names[name], max_bytes)

    def read(self, name: str) -> torch.Tensor:
        return self._source.read(self._names[name])

    def same_storage(self, a: str, b: str) -> bool:
        same = getattr(self._source, "same_storage", None)
        return bool(same and same(self._names[a], self._names[b]))

    def verify_reads(self) -> None:
        verify = getattr(self._source, "verify_reads", None)
        if verify is not None:
            verify()

    def close(self) -> None:
        self._source.close()


def qualified(namespace: str | None, name: str) -> str:
    """``"<namespace>::<name>"``; the bare name when ``namespace`` is None (a single source)."""
    return name if namespace is None else f"{namespace}{SEPARATOR}{name}"


class NamespacedSource:
    def __init__(self, sources: Mapping[str, TensorSource]) -> None:
        self._sources = dict(sources)
        self.url = next(iter(self._sources.values())).url if self._sources else ""
        self._metas = {qualified(ns, name): TensorMeta(qualified(ns, name), meta.shape, meta.dtype)
                       for ns, source in self._sources.items() for name, meta in source.metas().items()}

    def _split(self, name: str) -> tuple[TensorSource, str]:
        namespace, _, inner = name.partition(SEPARATOR)
        return self._sources[namespace], inner

    def metas(self) -> Mapping[str, TensorMeta]:
        return self._metas

    def iter_chunks(self, name: str, max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        source, inner = self._split(name)
        return source.iter_chunks(inner, max_bytes)

    def read(self, name: str) -> torch.Tensor:
        source, inner = self._split(name)
        return source.read(inner)

    def url_of(self, name: str) -> str:
        return self._split(name)[0].url

    def verify_reads(self) -> None:
        for source in self._sources.values():
            verify = getattr(source, "verify_reads", None)
            if verify is not None:
                verify()

    def close(self) -> None:
        for source in self._sources.values():
            source.close()
