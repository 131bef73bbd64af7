"""Benchmark: CPU per GB of the S3 clients — stepmerge's read and write paths (s3fs) against s3fs alone and obstore.

    python -m benchmarks.s3_clients                            # the 2.5 GB checkpoint, every client
    python -m benchmarks.s3_clients --obstore-lib /tmp/obstore-lib   # obstore from a `pip install --target` folder

What it does: starts SeaweedFS on loopback (`tests.servers.SeaweedS3Server`), uploads the rank files of
`benchmarks.fsdp_merge`'s checkpoint, then, each in a child process of its own (this parent never imports
torch or a client):
- reads every rank file front to back into a reused 16 MiB buffer (what a shard job's reader does):
  ``stepmerge`` through `storage.RangeReader` (read-ahead, pinned ETags, retries), ``s3fs`` through
  s3fs's ``_cat_file`` with the same 8 MiB parts and requests in flight, ``obstore`` through
  ``get_range_async`` with the same parts and requests in flight;
- writes a 1 GiB object from a reused 16 MiB buffer (what a shard job's writer does): ``stepmerge``
  through `storage.open_write` (`s3_upload.S3PartsUpload`: 16 MiB parts, 4 in flight), ``obstore``
  through ``put`` with the same part size and concurrency.
Each child prints the CPU seconds (user + system, `getrusage`) and wall of the transfer alone (after
imports and client setup) and the GETs/PUTs it sent; the parent adds the child's whole CPU, peak RSS
(wait4) and prints CPU s per GB. The server's CPU is never counted: it is not a child of the client.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from pathlib import Path

from benchmarks.harness import BENCH, measure

PART = 8 * 1024 * 1024  # tuning.READ_PART_BYTES
IN_FLIGHT = 32  # tuning.REQUESTS_IN_FLIGHT
CHUNK = 16 * 1024 * 1024  # a shard job's chunk
UPLOAD_PART = 16 * 1024 * 1024  # tuning.UPLOAD_PART
UPLOADS_IN_FLIGHT = 4  # tuning.UPLOAD_PARTS_IN_FLIGHT
WRITE_BYTES = 1024 ** 3

READERS = ("stepmerge", "s3fs", "obstore")
WRITERS = ("stepmerge", "obstore")
PROFILE = os.environ.get("STEPMERGE_BENCH_PROFILE")  # a folder: profile every child with py-spy into it


def _usage() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _obstore_store(bucket: str):
    from obstore.store import S3Store

    return S3Store(bucket, endpoint=os.environ["STEPMERGE_S3_ENDPOINT"],
                   access_key_id=os.environ["AWS_ACCESS_KEY_ID"], secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                   region=os.environ.get("AWS_REGION", "us-east-1"), virtual_hosted_style_request=False,
                   client_options={"allow_http": True})


def child_read(client: str, urls: list[str]) -> dict:
    """Read every file of ``urls`` front to back into one reused CHUNK buffer with ``client``."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    requests = [0]
    if client == "stepmerge":
        from merge_engine import storage
        from merge_engine.storage.backends import s3

        read_range = s3.S3Backend.read_range

        async def counted(self, *args, **kwargs):
            requests[0] += 1
            return await read_range(self, *args, **kwargs)

        s3.S3Backend.read_range = counted
        folder = urls[0].rsplit("/", 1)[0]
        entries = {storage.join(folder, e.path): e for e in storage.list_files(folder)}
        started, cpu = time.perf_counter(), _usage()
        total = 0
        for url in urls:
            with storage.RangeReader.listed(url, entries[url]) as reader:
                for offset in range(0, reader.size, CHUNK):
                    n = min(CHUNK, reader.size - offset)
                    reader.read_into(offset, view[:n])
                    total += n
    else:
        import asyncio

        if client == "s3fs":
            from merge_engine import storage

            fs, _ = storage.filesystem(urls[0])
            sizes = {url: int(fs.size(url)) for url in urls}
            loop = fs.loop

            async def get(url: str, start: int, end: int):
                return await fs._cat_file(url, start=start, end=end)
        else:
            import obstore

            bucket = urls[0].split("/")[2]
            store = _obstore_store(bucket)
            keys = {url: url.split("/", 3)[3] for url in urls}
            sizes = {url: obstore.head(store, keys[url])["size"] for url in urls}
            loop = None

            async def get(url: str, start: int, end: int):
                return await obstore.get_range_async(store, keys[url], start=start, end=end)

        async def read_file(url: str) -> int:
            """PART-sized GETs, IN_FLIGHT at once, consumed in order into the CHUNK buffer."""
            size = sizes[url]
            starts = list(range(0, size, PART))
            pending: dict[int, asyncio.Task] = {}
            next_start = 0
            done = 0
            for index, start in enumerate(starts):
                while next_start < len(starts) and next_start < index + IN_FLIGHT:
                    s = starts[next_start]
                    pending[next_start] = asyncio.ensure_future(get(url, s, min(s + PART, size)))
                    requests[0] += 1
                    next_start += 1
                data = memoryview(await pending.pop(index))
                at = start % CHUNK
                view[at:at + len(data)] = data
                done += len(data)
            return done

        async def read_all() -> int:
            return sum([await read_file(url) for url in urls])

        started, cpu = time.perf_counter(), _usage()
        if loop is not None:
            total = asyncio.run_coroutine_threadsafe(read_all(), loop).result()
        else:
            total = asyncio.run(read_all())
    return {"bytes": total, "wall_s": time.perf_counter() - started, "cpu_s": _usage() - cpu,
            "requests": requests[0]}


def child_write(client: str, url: str) -> dict:
    """Write WRITE_BYTES to ``url`` from one reused CHUNK buffer with ``client``."""
    chunk = memoryview(os.urandom(CHUNK))
    count = WRITE_BYTES // CHUNK
    requests = [0]
    if client == "stepmerge":
        from merge_engine import storage
        from merge_engine.storage import s3_upload

        put_part = s3_upload.S3PartsUpload._put_part

        def counted(self, *args):
            requests[0] += 1
            return put_part(self, *args)

        s3_upload.S3PartsUpload._put_part = counted
        storage.exists(url)  # the client built and connected before the clock starts
        started, cpu = time.perf_counter(), _usage()
        with storage.open_write(url, size_hint=WRITE_BYTES) as out:
            for _ in range(count):
                out.write(chunk)
    else:
        import obstore

        bucket, key = url.split("/", 3)[2:]
        store = _obstore_store(bucket)
        obstore.list(store, prefix="none").collect()  # the client built and connected before the clock starts

        def chunks():
            for _ in range(count):
                requests[0] += 1
                yield chunk

        started, cpu = time.perf_counter(), _usage()
        obstore.put(store, key, chunks(), chunk_size=UPLOAD_PART, max_concurrency=UPLOADS_IN_FLIGHT)
    return {"bytes": WRITE_BYTES, "wall_s": time.perf_counter() - started, "cpu_s": _usage() - cpu,
            "requests": requests[0]}


def run_child(args: list[str], env: dict[str, str]) -> dict:
    """One child: its own figures (JSON on stdout) plus its whole CPU and peak RSS from wait4."""
    out = BENCH / "out" / "s3_clients.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.s3_clients", "--child", str(out), *args]
    if PROFILE:  # py-spy's collapsed stacks of the child, one file per client (its CPU counts in the child's)
        command = [str(Path(sys.executable).with_name("py-spy")), "record", "-r", "250", "-f", "raw", "--threads",
                   "-o", f"{PROFILE}/{args[0]}-{args[1]}.txt", "--", *command]
    run = measure(args[0], command, env)
    figures = json.loads(out.read_text())
    out.unlink()
    return {**figures, "process_cpu_s": run.cpu_s, "peak_rss_mb": run.peak_rss_mb}


def compare(env: dict[str, str], source_urls: list[str], bucket: str, repeats: int,
            readers: tuple[str, ...] = READERS, writers: tuple[str, ...] = WRITERS) -> dict[str, dict]:
    """Every reader and writer, ``repeats`` times each, alternating; the run with the least transfer CPU kept."""
    results: dict[str, dict] = {}
    for _ in range(repeats):
        for client in readers:
            run = run_child(["read", client, *source_urls], env)
            key = f"read {client}"
            if key not in results or run["cpu_s"] < results[key]["cpu_s"]:
                results[key] = run
        for client in writers:
            run = run_child(["write", client, f"{bucket}/written/{client}.bin"], env)
            key = f"write {client}"
            if key not in results or run["cpu_s"] < results[key]["cpu_s"]:
                results[key] = run
    return results


def print_comparison(results: dict[str, dict]) -> None:
    print(f"  {'client':18s} {'GB':>5s} {'wall s':>7s} {'MB/s':>6s} {'CPU s':>6s} {'CPU s/GB':>8s} "
          f"{'process CPU s':>13s} {'peak RSS MB':>11s} {'requests/GB':>11s}")
    for key, r in results.items():
        gb = r["bytes"] / 1e9
        print(f"  {key:18s} {gb:5.2f} {r['wall_s']:7.2f} {r['bytes'] / r['wall_s'] / 1e6:6.0f} {r['cpu_s']:6.2f} "
              f"{r['cpu_s'] / gb:8.2f} {r['process_cpu_s']:13.2f} {r['peak_rss_mb']:11.0f} {r['requests'] / gb:11.1f}")
    for kind, ours in (("read", "read stepmerge"), ("write", "write stepmerge")):
        other = results.get(f"{kind} obstore")
        if other and ours in results:
            a = results[ours]["cpu_s"] / results[ours]["bytes"]
            b = other["cpu_s"] / other["bytes"]
            print(f"  {kind}: obstore CPU per GB / stepmerge's: {b / a:.2f} ({(1 - b / a) * 100:+.0f} % cut)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--obstore-lib", help="a folder holding obstore (pip install --target), put on PYTHONPATH")
    parser.add_argument("--clients", help=f"comma-separated, from {','.join(READERS)} (default: all)")
    parser.add_argument("--kinds", default="read,write", help="read and/or write")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        out, kind, client, *urls = args.child
        figures = child_read(client, urls) if kind == "read" else child_write(client, urls[0])
        with open(out, "w") as f:
            json.dump(figures, f)
        return

    from benchmarks.fsdp_merge import ensure_checkpoint
    from tests.servers import SeaweedS3Server

    BENCH.mkdir(exist_ok=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    actor = ensure_checkpoint("0.5b")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.obstore_lib:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), args.obstore_lib, env.get("PYTHONPATH")) if p)
    has_obstore = subprocess.run([sys.executable, "-c", "import obstore"], env=env, capture_output=True).returncode == 0
    chosen = set((args.clients or ",".join(READERS)).split(","))
    kinds = set(args.kinds.split(","))
    readers = tuple(c for c in READERS if c in chosen and (has_obstore or c != "obstore") and "read" in kinds)
    writers = tuple(c for c in WRITERS if c in chosen and (has_obstore or c != "obstore") and "write" in kinds)
    if not has_obstore:
        print("obstore is not importable (pass --obstore-lib): s3fs and stepmerge only")
    with SeaweedS3Server() as s3:
        env.update(s3.env())
        bucket = s3.make_bucket("bench")
        source = f"{bucket}/run/global_step_1/actor"
        if readers:
            subprocess.run([sys.executable, "-c", "import sys; from merge_engine import storage; "
                            "storage.copy_tree(sys.argv[1], sys.argv[2])", str(actor), source], env=env, check=True)
        urls = [f"{source}/{p.name}" for p in sorted(actor.glob("model_world_size_*_rank_*.pt"))]
        print(f"\n== S3 clients against SeaweedFS on loopback: read {len(urls)} rank files, write 1 GiB; "
              f"best of {args.repeats} (least transfer CPU)")
        print_comparison(compare(env, urls, bucket, args.repeats, readers, writers))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
