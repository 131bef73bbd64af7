"""The floors a local merge is measured against, each one child process (run by `benchmarks.shard_jobs`).

    python -m benchmarks.data_path_floor loop OUT_FILE RANK_FILE...   # read + cast + sha256 + write
    python -m benchmarks.data_path_floor loop --copy OUT_FILE FILE... # read + sha256 + write, no cast
    python -m benchmarks.data_path_floor imports                     # what a merge imports, nothing else

``cp`` does no cast and no sha256, so a merge cannot reach it. These two say what can be reached:
- ``loop``: ``import torch``, then every rank file read front to back in `CHUNK_BYTES` pieces with
  ``readinto`` into one reused buffer, each piece cast fp32 -> bf16 into a reused buffer
  (``Tensor.copy_``), written with the merge's own direct-I/O writer (`merge_engine.storage.direct_io`,
  fsynced at the end, as a merge commits), and hashed with sha256 in a second thread overlapped
  with the read, cast and write (``--serial``: in the same thread). No pickle, no plan, no Hub
  names: the merge's per-byte work in the tightest loop Python allows. ``--copy``: the bytes copied
  as they are (fp32 kept, as every trainer's own consolidator keeps them: `benchmarks.trainer_peers`).
- ``imports``: the interpreter with the modules a FSDP merge imports (torch, stepmerge's engine,
  torch's DTensor placement code, transformers' conversion table for Hub names) and nothing run.
A merge costs about ``imports`` + ``loop`` - one torch import + its planning; the figures say
how close it gets.
"""

from __future__ import annotations

import hashlib
import queue
import sys
import threading

CHUNK_BYTES = 16 * 1024 * 1024
RING = 4  # bf16 buffers: one being filled, the rest written or waiting for / in the hasher


def loop(out_path: str, rank_files: list[str], serial: bool = False, cast: bool = True) -> str:
    """Read, cast (``cast``: fp32 -> bf16, else a copy of the fp32 values), write and hash ``rank_files`` into
    ``out_path``; the sha256 (hex) of what was written."""
    import torch

    from merge_engine.storage.direct_io import DirectFile

    torch.set_num_threads(1)
    src = torch.empty(CHUNK_BYTES // 4, dtype=torch.float32)
    src_bytes = memoryview(src.view(torch.uint8).numpy())
    ring = [torch.empty(CHUNK_BYTES // 4, dtype=torch.bfloat16 if cast else torch.float32) for _ in range(RING)]
    free: queue.Queue = queue.Queue()
    for buffer in ring:
        free.put(buffer)
    pending: queue.Queue = queue.Queue(maxsize=RING - 1)
    digest = hashlib.sha256()

    def hash_all() -> None:
        while (item := pending.get()) is not None:
            buffer, n = item
            digest.update(memoryview(buffer[:n].view(torch.uint8).numpy()))
            free.put(buffer)

    hasher = None if serial else threading.Thread(target=hash_all, daemon=True)
    if hasher is not None:
        hasher.start()
    out = DirectFile(out_path)
    try:
        for path in rank_files:
            with open(path, "rb", buffering=0) as f:
                while got := f.readinto(src_bytes):
                    n = got // 4
                    buffer = free.get()
                    buffer[:n].copy_(src[:n])
                    data = memoryview(buffer[:n].view(torch.uint8).numpy())
                    out.write(data)
                    if hasher is None:
                        digest.update(data)
                        free.put(buffer)
                    else:
                        pending.put((buffer, n))
        if hasher is not None:
            pending.put(None)
            hasher.join()
    finally:
        out.close()  # writes the tail and fsyncs, as a merge's commit does
    return digest.hexdigest()


def imports() -> None:
    import torch.distributed.tensor  # noqa: F401 - FSDP2 placements
    import transformers.conversion_mapping  # noqa: F401 - Hub names

    import merge_engine.cli  # noqa: F401
    import merge_engine.commands.merge  # noqa: F401


def main() -> None:
    what, *rest = sys.argv[1:]
    if what == "imports":
        imports()
    elif what == "loop":
        paths = [p for p in rest if p not in ("--serial", "--copy")]
        print(loop(paths[0], paths[1:], "--serial" in rest, "--copy" not in rest))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
