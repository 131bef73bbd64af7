"""Which local input files may be read or copied: regular files inside the folder given, of bounded size.

Anyone who can write a checkpoint folder must not be able to make a merge worker read, copy or
publish a file of the host (``huggingface/special_tokens_map.json -> /etc/passwd``), nor feed it an
endless stream (``-> /dev/zero``), a FIFO that blocks forever, or a device. Policy (refuse, never
skip: a checkpoint that asks for a host file is not one to publish with a piece missing):

- A symbolic link is followed only when its final target lies inside the folder being read (the
  checkpoint, or the metadata folder), or, for a Hugging Face hub cache snapshot
  (``.../models--<name>/snapshots/<revision>/``, where every file is a link into ``../../blobs``),
  inside that cache repository. Any other link raises `UnsafeFile`, whether it points to a file or
  a folder.
- What is read must be a regular file (a link's target too): a FIFO, socket or device raises
  `UnsafeFile`.
- Metadata files copied into an output (tokenizer, chat template, generation config, code) are at
  most `MAX_METADATA_FILE_BYTES` each, and exactly the listed number of bytes is copied.
- A metadata file whose name could pass for another (a newline, the right-to-left override U+202E, any
  control or format character: `file_name_fault`) is never copied into an output: it is skipped with
  one bounded log line (the merge needs none of these files; the model is published without it).

Object stores have no links and no special files; only the size bound applies to them.
"""

from __future__ import annotations

import os
import re
import stat
import unicodedata
from collections.abc import Iterator

from merge_engine import storage
from merge_engine.errors import UnsafeFile

MAX_METADATA_FILE_BYTES = 256 * 1024 * 1024  # the largest tokenizer.json seen is ~30 MB
_HF_CACHE_SNAPSHOT = re.compile(r"^(?P<repo>.*/models--[^/]+)/snapshots/[^/]+$")


def allowed_roots(root: str) -> tuple[str, ...]:
    """The real folders a link under ``root`` may point into: ``root`` itself, plus the cache
    repository when ``root`` is a Hugging Face hub cache snapshot."""
    real = os.path.realpath(root)
    match = _HF_CACHE_SNAPSHOT.match(real)
    return (real, match["repo"]) if match else (real,)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def check_local_entry(path: str, roots: tuple[str, ...], *, want_file: bool = True) -> os.stat_result:
    """The stat of what ``path`` names, after refusing a link out of ``roots`` or a special file.

    ``want_file``: the final target must be a regular file (else a folder is accepted too).
    """
    try:
        lstat = os.lstat(path)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(lstat.st_mode):
        target = os.path.realpath(path)
        if not _inside(target, roots):
            raise UnsafeFile(f"symbolic link to {target}, outside the folder being read: refused", path)
        try:
            final = os.stat(path)
        except FileNotFoundError:
            raise UnsafeFile(f"dangling symbolic link to {target}", path) from None
    else:
        final = lstat
    if stat.S_ISREG(final.st_mode) or (not want_file and stat.S_ISDIR(final.st_mode)):
        return final
    kind = ("a FIFO" if stat.S_ISFIFO(final.st_mode) else "a device" if stat.S_ISCHR(final.st_mode)
            or stat.S_ISBLK(final.st_mode) else "a socket" if stat.S_ISSOCK(final.st_mode) else "a folder"
            if stat.S_ISDIR(final.st_mode) else "not a regular file")
    raise UnsafeFile(f"{kind}, not a regular file: refused", path)


def walk_entries(root: str) -> Iterator[os.DirEntry]:
    """Every entry under the local folder ``root``, at any depth, without following links: a folder that is a link
    is yielded, never descended. A folder removed while it is walked is skipped."""
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    yield entry
        except FileNotFoundError:
            continue


def check_local_tree(url: str) -> None:
    """Refuse (`UnsafeFile`) a local folder holding a link out of it or a special file, at any depth.

    Folders that are links are checked but not descended (listings do not descend them either).
    Remote URLs and missing folders pass: there is nothing of the kind there.
    """
    if not storage.is_local(url):
        return
    root = storage.local_path(url)
    if not os.path.isdir(root):
        return
    roots = allowed_roots(root)
    for entry in walk_entries(root):
        if entry.is_symlink():
            check_local_entry(entry.path, roots, want_file=False)
        elif not entry.is_dir(follow_symlinks=False) and not entry.is_file(follow_symlinks=False):
            check_local_entry(entry.path, roots)  # raises: FIFO, socket, device


MAX_FILE_NAME_BYTES = 255  # the usual file system limit (ext4, xfs, APFS)


def file_name_fault(name: str) -> str | None:
    """Why the file name ``name`` may not be copied into an output; None when it may.

    A copied name must read as what it is wherever it is shown (a log line, a listing, the Hub's file view):
    no control or format character (a newline, NUL, the right-to-left override U+202E, a zero-width space:
    Unicode categories C*), no line or paragraph separator, no ``/`` or ``\\``, not ``.`` or ``..``, and at most
    `MAX_FILE_NAME_BYTES` bytes of UTF-8."""
    if name in ("", ".", ".."):
        return "not a file name"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_FILE_NAME_BYTES:
        return f"longer than {MAX_FILE_NAME_BYTES} bytes"
    for char in name:
        if char in "/\\" or unicodedata.category(char)[0] == "C" or unicodedata.category(char) in ("Zl", "Zp"):
            return f"holds the character U+{ord(char):04X} ({unicodedata.name(char, 'unnamed')})"
    return None


def check_metadata_file(url: str, root: str, listed_size: int) -> None:
    """A metadata file about to be copied from folder ``root``: regular, inside, at most the bound."""
    if listed_size > MAX_METADATA_FILE_BYTES:
        raise UnsafeFile(f"{listed_size} bytes, more than a metadata file may hold "
                         f"({MAX_METADATA_FILE_BYTES} bytes): refused", url)
    if storage.is_local(url):
        final = check_local_entry(storage.local_path(url), allowed_roots(storage.local_path(root)))
        if final.st_size != listed_size:
            raise UnsafeFile(f"changed while being read: {final.st_size} bytes, listed {listed_size}", url)


__all__ = ["MAX_FILE_NAME_BYTES", "MAX_METADATA_FILE_BYTES", "allowed_roots", "check_local_entry",
           "check_local_tree", "check_metadata_file", "file_name_fault"]
