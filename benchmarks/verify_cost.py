"""Benchmark: what verifying a release costs (`stepmerge verify`, the pipeline's "already published?").

    python -m benchmarks.verify_cost                  # a 512 MiB release, local disk and SeaweedFS S3
    python -m benchmarks.verify_cost --mib 2048 --no-s3

What it does: publishes one release of ``--mib`` MiB (four shards of random bytes) to a local folder
and, unless ``--no-s3``, to a SeaweedFS S3 server started for the run; then times, on each,
``verify_folder(mode="full")`` (every byte re-hashed) and ``verify_folder(mode="quick")`` (object
stores: the store's versions recorded at publish time against one listing; local: re-hashed), and
prints seconds, MB/s and bytes read. Figures depend on the machine's load: compare them within a run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from merge_engine import storage
from merge_engine.release.publish import publish
from merge_engine.release.verify import verify_folder


def _release(staging: str, release: str) -> None:
    publish(staging, release, source="benchmark", fingerprint="fp", options={}, validation=None,
            engine_version="bench", remove_staging=False)


def _time(release: str, mode: str) -> tuple[float, int]:
    started = time.perf_counter()
    report = verify_folder(release, mode=mode)
    assert report.ok, report.summary()
    return time.perf_counter() - started, report.bytes_hashed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="verify-cost-") as tmp:
        staging = os.path.join(tmp, "staging")
        os.makedirs(staging)
        shard = args.mib * 1024 * 1024 // 4
        for i in range(4):
            with open(os.path.join(staging, f"model-0000{i + 1}-of-00004.safetensors"), "wb") as f:
                for _ in range(0, shard, 1 << 24):
                    f.write(os.urandom(min(1 << 24, shard)))
        targets = {"local": os.path.join(tmp, "releases", "global_step_1")}
        server = None
        if not args.no_s3:
            from tests.servers import SeaweedS3Server

            server = SeaweedS3Server().__enter__()
            os.environ.update(server.env())
            targets["s3"] = storage.join(server.make_bucket("bench"), "releases", "global_step_1")
        try:
            total = sum(e.size for e in storage.list_files(staging))
            print(f"release of {total / 1e6:.0f} MB in 4 files")
            for where, release in targets.items():
                _release(staging, release)
                for mode in ("full", "quick"):
                    seconds, hashed = _time(release, mode)
                    rate = hashed / seconds / 1e6 if hashed else 0.0
                    print(f"  {where:5s} {mode:5s}: {seconds:7.3f} s, {hashed / 1e6:7.0f} MB re-hashed"
                          + (f" ({rate:.0f} MB/s)" if hashed else " (no byte read)"))
        finally:
            if server is not None:
                server.__exit__(None, None, None)


if __name__ == "__main__":
    main()
