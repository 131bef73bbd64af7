"""``make demo`` / ``python -m flows.demo [--s3]``: the whole pipeline on a small training run.

1. Writes a demo verl run under ``./demo/run`` with real ``torch.distributed`` (4-rank FSDP2, a tiny
   Qwen2; steps 1 and 2 full fine-tuning, step 3 with LoRA), unless it is already there.
   ``--s3`` starts a local SeaweedFS server and uploads the run to ``s3://stepmerge-demo/run``.
2. Runs ``merge_new_steps`` in Prefect's local mode (a temporary server, state in ``./demo/.prefect``,
   started first and given `SERVER_START_TIMEOUT_S` to answer: Prefect's own 20 s is too short on a
   busy machine; if it still does not answer, one line says what to do, and the exit status is 1):
   every complete step not yet released is merged, validated and published, the LoRA step also
   as a PEFT adapter. Prints where each release is, what was validated, and each stage's time.
3. Runs ``merge_step`` again for every step: cache hits, no weight byte read (counted), and the time.
Run it again: the run and the releases are there, so step 2 finds nothing new and step 3 is all
cache. ``rm -rf demo`` starts over.
"""

import argparse
import contextlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator, List

DEMO_DIR = Path("demo")
STEPS = (1, 2, 3)
LORA_STEP = 3
S3_BUCKET = "stepmerge-demo"
SERVER_START_TIMEOUT_S = 180


def _quiet_environment() -> None:
    """Before Prefect / transformers are imported: no telemetry, demo-local Prefect state, quiet logs."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not os.environ.get("PREFECT_API_URL"):  # local mode; a configured server is used as it is
        os.environ.setdefault("PREFECT_HOME", str((DEMO_DIR / ".prefect").resolve()))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("STEPMERGE_STAGING_DIR", str((DEMO_DIR / ".staging").resolve()))
    # Prefect's own 20 s was exceeded twice in a row on a loaded 2-core machine (FIELD_NOTES).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(SERVER_START_TIMEOUT_S))
    warnings.filterwarnings("ignore", category=FutureWarning)


class PrefectDidNotStart(Exception):
    """Prefect's temporary server did not answer in time (the message says what to do)."""


def start_prefect() -> str:
    """Reach the Prefect API before any work: the configured server, or a temporary one started now.

    Returns where it is. Raises `PrefectDidNotStart` (one line saying what to do) when the temporary
    server does not answer within ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``.
    """
    from prefect.client.orchestration import get_client

    timeout = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(SERVER_START_TIMEOUT_S))
    try:
        with get_client(sync_client=True) as client:
            client.api_healthcheck()
            return str(client.api_url)
    except RuntimeError as exc:
        if "ephemeral Prefect API server" not in str(exc):
            raise
        raise PrefectDidNotStart(
            f"Prefect's temporary server did not start within {timeout} s (a busy machine?): run it again with "
            f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={max(2 * int(timeout or 0), 300)}, or start "
            "`prefect server start` elsewhere and set PREFECT_API_URL=http://127.0.0.1:4200/api") from None


def write_demo_run(run_dir: Path) -> float:
    """Write the demo run if it is not complete yet; returns the seconds spent (0 when reused)."""
    from synthetic_runs.fsdp import FsdpSpec, LoraSpec, StepJob, write_fsdp_steps

    if all((run_dir / f"global_step_{s}" / "actor" / "fsdp_config.json").exists() for s in STEPS):
        return 0.0
    started = time.perf_counter()
    full = FsdpSpec(world_size=4, strategy="fsdp2")
    lora = FsdpSpec(world_size=4, strategy="fsdp2", lora=LoraSpec(r=4, alpha=8))
    jobs = [StepJob(str(run_dir / f"global_step_{s}"), lora if s == LORA_STEP else full, s) for s in STEPS]
    write_fsdp_steps(jobs)
    (run_dir / "latest_checkpointed_iteration.txt").write_text(str(STEPS[-1]))
    return time.perf_counter() - started


class ByteCounter:
    """Counts the bytes read through `merge_engine.storage.RangeReader` (every weight read goes there)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.reads = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator["ByteCounter"]:
        from merge_engine import storage

        original = storage.RangeReader.read_into

        def read_into(reader: storage.RangeReader, offset: int, buffer: memoryview | bytearray) -> None:
            self.reads += 1
            self.bytes += memoryview(buffer).nbytes
            return original(reader, offset, buffer)

        # the method every weight read goes through, wrapped for the demo's run and put back after it
        setattr(storage.RangeReader, "read_into", read_into)
        try:
            yield self
        finally:
            setattr(storage.RangeReader, "read_into", original)


def _validated(summary: str) -> str:
    lines = [line for line in summary.splitlines() if line.startswith("- ")]
    names = [line.split("`")[1] for line in lines if "`" in line]
    passed = sum("PASS" in line for line in lines)
    return f"{passed}/{len(lines)} checks passed ({', '.join(names)})" if lines else "(no checks recorded)"


def print_outcomes(outcomes: List) -> None:
    from flows.summaries import human_size

    for outcome in outcomes:
        status = outcome.status.replace("_", " ")
        print(f"\n  step {outcome.step} ({outcome.role}): {status} in {outcome.seconds:.2f} s")
        for release in outcome.releases:
            print(f"    {release.kind:8s} -> {release.url}")
            print(f"             {release.tensors} tensors, {human_size(release.tensor_bytes)}; "
                  f"validated: {_validated(release.validation_summary)}")
        stages = "  ".join(f"{s.name} {s.seconds:.2f}s{' (cached)' if s.state == 'Cached' else ''}"
                           for s in outcome.stages)
        print(f"    stages: {stages}")


def stage_totals(outcomes: List) -> dict:
    totals: dict = {}
    for outcome in outcomes:
        for stage in outcome.stages:
            totals[stage.name] = totals.get(stage.name, 0.0) + stage.seconds
    return totals


def run_demo(run_root: str, release_root: str) -> None:
    from flows.merge_new_steps import merge_new_steps
    from flows.merge_step import merge_step

    print(f"\n== merge_new_steps (Prefect local mode) on {run_root}")
    started = time.perf_counter()
    watch = merge_new_steps(run_root=run_root, release_root=release_root)
    first = time.perf_counter() - started
    merged = watch.steps_with("merged")
    news = f"merged step(s) {', '.join(map(str, merged))}" if merged else "nothing new: every complete step is released"
    print(f"   {news} ({watch.published_before} step(s) published before); {first:.1f} s including Prefect's "
          "start-up")
    print_outcomes(watch.outcomes)
    if watch.outcomes:
        totals = stage_totals(watch.outcomes)
        print("\n   time per stage, all steps: " + ", ".join(f"{k} {v:.2f}s" for k, v in totals.items()))

    print("\n== the same steps again with merge_step: the cache at work")
    counter = ByteCounter()
    rerun = []
    started = time.perf_counter()
    with counter.counting():
        for step in STEPS:
            rerun.append(merge_step(step=step, run_root=run_root, release_root=release_root))
    again = time.perf_counter() - started
    for outcome in rerun:
        cached = [s.name for s in outcome.stages if s.state == "Cached"]
        fresh = [s.name for s in outcome.stages if s.state != "Cached"]
        print(f"   step {outcome.step}: {'cache hit' if outcome.cached else outcome.status} in {outcome.seconds:.2f} s "
              f"(cached: {', '.join(cached)}; ran: {', '.join(fresh)}: one listing)")
    print(f"   re-run of {len(STEPS)} steps: {again:.2f} s in all (Prefect's per-flow-run overhead included), "
          f"{counter.bytes} bytes read ({counter.reads} ranged reads: no checkpoint byte; a local release is "
          f"re-hashed against its manifest before the cache is trusted, an object-store one is checked from "
          f"its listing)")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--s3", action="store_true", help="run against a local SeaweedFS server")
    args = parser.parse_args(argv)
    _quiet_environment()
    DEMO_DIR.mkdir(exist_ok=True)
    started = time.perf_counter()
    try:
        api = start_prefect()
    except PrefectDidNotStart as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    print(f"== Prefect API at {api} ({time.perf_counter() - started:.1f} s)")
    run_dir = (DEMO_DIR / "run").resolve()
    print(f"== demo training run: {run_dir} (4-rank FSDP2, steps {', '.join(map(str, STEPS))}; "
          f"step {LORA_STEP} with LoRA)")
    spent = write_demo_run(run_dir)
    print(f"   written in {spent:.1f} s" if spent else "   already there (rm -rf demo to write it again)")
    temporary = not os.environ.get("PREFECT_API_URL")
    if not args.s3:
        releases = (DEMO_DIR / "releases").resolve()
        run_demo(str(run_dir), str(releases))
        print(next_steps(str(releases), api, temporary, command_prefix()))
        return 0

    from merge_engine import storage
    from synthetic_runs.servers import SeaweedS3Server, applied_env

    with SeaweedS3Server() as server, applied_env(server.env(), server.unset_env()):
        bucket = server.make_bucket(S3_BUCKET)
        run_root = f"{bucket}/run"
        started = time.perf_counter()
        files = [p for p in run_dir.rglob("*") if p.is_file()]
        for path in files:
            storage.copy_file(str(path), storage.join(run_root, path.relative_to(run_dir).as_posix()))
        print(f"== SeaweedFS at {server.endpoint_url}: uploaded {len(files)} files to {run_root} "
              f"in {time.perf_counter() - started:.1f} s")
        run_demo(run_root, f"{bucket}/releases")
    print(next_steps(f"{bucket}/releases (in the demo's SeaweedFS server, stopped now)", api, temporary,
                     command_prefix()))
    return 0


def command_prefix() -> str:
    """The prefix that makes this environment's commands (``stepmerge``, ``prefect``) run as printed.

    Returns:
        ``""`` when the shell's PATH already finds this environment's ``stepmerge``; otherwise the folder of
        this Python's scripts with a trailing slash, relative to the current folder when it lies under it
        (``.venv/bin/`` after ``make demo``).
    """
    scripts = Path(sys.executable).parent
    found = shutil.which("stepmerge")
    if found is not None and Path(found).parent.resolve() == scripts.resolve():
        return ""
    with contextlib.suppress(ValueError):
        return f"{scripts.absolute().relative_to(Path.cwd())}/"
    return f"{scripts.absolute()}/"


def next_steps(releases: str, api: str, temporary: bool, bin_prefix: str = "") -> str:
    """What to do after the demo: where its releases are, where its runs can be seen, how to go on.

    Args:
        releases: where the demo published its releases.
        api: the Prefect API the demo used.
        temporary: whether that server stopped with the demo.
        bin_prefix: put before each command so that it runs as printed (`command_prefix`).
    """
    ui = api.rstrip("/").removesuffix("/api")
    if temporary:
        seen = (f"   the runs were recorded by a temporary Prefect server ({ui}), stopped with the demo: to browse\n"
                f"   them in the UI, start `{bin_prefix}prefect server start` in another terminal, then run\n"
                f"   PREFECT_API_URL=http://127.0.0.1:4200/api make demo  and open http://127.0.0.1:4200/runs")
    else:
        seen = f"   the runs: {ui}/runs (tagged run:<run root>; each has a summary artifact)"
    return "\n".join([
        "\n== next",
        f"   the releases: {releases}  (check one: {bin_prefix}stepmerge verify <release folder>)",
        seen,
        f"   your own run: {bin_prefix}stepmerge discover --run-root <run root>; to merge every new step as "
        "training goes,",
        "   deploy the pipeline: deployments/README.md (server, work pools, workers, make deploy)",
    ])


if __name__ == "__main__":
    sys.exit(main())
