"""Local outputs appear whole, temp folders of live writers survive (issue 9, cases 8, 9, 10).

Specification (`merge_engine.output.local_commit`, `merge_engine.output.target`):
- case 10: replacing a folder (``--overwrite``) is an atomic swap: an observer listing the target
  while it is replaced again and again only ever sees the whole old folder or the whole new one,
  never a mix and never nothing; a merge killed in its commit window (held there: its output written
  beside the target, or just swapped in) leaves the whole old folder or the whole new one;
- case 9: concurrent merges of one checkpoint into one target all succeed (no "Directory not
  empty"), the target is whole and no temp folder is left;
- case 8: a live temp folder of a writer in another PID namespace (a real one, `unshare`) survives
  another process's sweep; a temp folder whose owner ran in this namespace and is gone is swept at
  once; another namespace's folder is swept only once its heartbeat is stale.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from merge_engine.output import local_commit

from merge_engine.output import process_identity
from merge_engine.output.local_commit import LiveFolder, commit_folder, sweep_dead_siblings
from merge_engine.commands.merge import merge_checkpoint

VARIANT = "fsdp2_qwen2"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _folder(path, tag: str, files: int) -> set[str]:
    os.makedirs(path)
    names = {f"{tag}-{i:03d}" for i in range(files)}
    for name in names:
        with open(os.path.join(path, name), "w") as f:
            f.write(tag)
    return names


def test_replacing_a_folder_never_shows_a_mix_or_nothing(tmp_path):
    target = str(tmp_path / "out")
    versions = {"v0": _folder(target, "v0", 200)}
    seen: list[frozenset[str]] = []
    stop = threading.Event()

    def observe() -> None:
        """Lists the folder AT THE TARGET PATH: a listing counts when the path named the same folder
        before and after it (a reader that opened the old folder just before a swap may see it go)."""
        while not stop.is_set():
            try:
                fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                seen.append(frozenset())
                continue
            try:
                inode = os.fstat(fd).st_ino
                names = frozenset(os.listdir(fd))
                if os.stat(target).st_ino == inode:
                    seen.append(names)
            except FileNotFoundError:
                seen.append(frozenset())
            finally:
                os.close(fd)

    observer = threading.Thread(target=observe)
    observer.start()
    try:
        for round_ in range(1, 15):
            with LiveFolder(target) as tmp:
                os.rmdir(tmp.path)
                versions[f"v{round_}"] = _folder(tmp.path, f"v{round_}", 200)
                assert commit_folder(tmp.path, target) is True
    finally:
        stop.set()
        observer.join()
    whole = {frozenset(v) for v in versions.values()}
    assert seen and all(s in whole for s in seen), "a listing saw a mixed or missing folder"
    assert set(os.listdir(target)) == versions["v14"]
    assert os.listdir(tmp_path) == ["out"]  # no temp sibling or owner record left


@pytest.fixture()
def checkpoint(fsdp_runs, tmp_path):
    copy = tmp_path / "actor"
    shutil.copytree(fsdp_runs[VARIANT].latest.checkpoint_dir, copy)
    return copy


def _whole(target) -> bool:
    """The folder holds exactly the files its stepmerge.json lists, with their sizes."""
    record = json.loads((target / "stepmerge.json").read_text())
    listed = {p.name: p.stat().st_size for p in target.iterdir() if p.name != "stepmerge.json"}
    return listed == record["files"]


KILLED_IN_THE_COMMIT = """
import sys, threading
import merge_engine.output.target as target
real = target.commit_folder
def held(folder, path):
    if sys.argv[1] == "entered":
        print("entered", flush=True)  # every file written in the temp folder; the target not yet touched
        threading.Event().wait()  # until killed
    replaced = real(folder, path)
    print("swapped", flush=True)  # the new folder at the target, the old one at the temp name
    threading.Event().wait()
target.commit_folder = held
from merge_engine.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("window, expected", [("entered", "old"), ("swapped", "new")])
def test_a_merge_killed_in_its_commit_window_leaves_a_whole_folder(window, expected, checkpoint, fsdp_runs,
                                                                    tmp_path):
    """The merge is held at an instant of its commit (its output written whole beside the target, or just
    swapped in) and SIGKILLed there: the target is the whole old folder, or the whole new one."""
    target = tmp_path / "out"
    other = fsdp_runs["fsdp2_llama_buffer_mqa"].latest.checkpoint_dir
    merge_checkpoint(str(checkpoint), str(target))
    old = json.loads((target / "stepmerge.json").read_text())["fingerprint"]
    process = subprocess.Popen([sys.executable, "-c", KILLED_IN_THE_COMMIT, window, "merge", "--local_dir", str(other),
                                "--target_dir", str(target), "--overwrite"],
                               env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True)
    try:
        reached = process.stdout.readline().strip()  # the merge holds there until killed
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert reached == window, f"the merge ended without reaching the commit window {window!r}"
    assert target.is_dir() and _whole(target), f"mixed folder after a kill at {window!r}"
    fingerprint = json.loads((target / "stepmerge.json").read_text())["fingerprint"]
    assert (fingerprint == old) == (expected == "old"), (window, fingerprint, old)
    assert sweep_dead_siblings(str(target))  # the killed writer's temp folder: its owner is dead, swept at once
    assert sorted(os.listdir(tmp_path)) == ["actor", "out"] and _whole(target)


def test_concurrent_merges_into_one_target_all_succeed(checkpoint, tmp_path):
    target = tmp_path / "out"
    for _ in range(3):
        errors: list[BaseException] = []

        def merge() -> None:
            try:
                merge_checkpoint(str(checkpoint), str(target))
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=merge) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [] and _whole(target)
        assert sorted(os.listdir(tmp_path)) == ["actor", "out"]  # no temp folder left behind
        shutil.rmtree(target)


def _fake_owner(folder, **identity) -> None:
    os.makedirs(folder)
    record = {**process_identity.current(), "heartbeat": time.time(), **identity}
    with open(folder + local_commit.OWNER_SUFFIX, "w") as f:
        json.dump(record, f)


def test_sweeping_decides_by_owner_and_heartbeat_never_by_pid_alone(tmp_path):
    target = str(tmp_path / "out")
    prefix = os.path.join(str(tmp_path), local_commit.temp_prefix(target))
    dead_here = subprocess.Popen(["true"])
    dead_here.wait()
    _fake_owner(prefix + "tmp-a", pid=dead_here.pid)  # this namespace, process gone: swept at once
    _fake_owner(prefix + "tmp-b", pid=dead_here.pid, pid_ns="pid:[1]")  # another namespace, fresh: kept
    _fake_owner(prefix + "tmp-c", pid=dead_here.pid, host="elsewhere")  # another host, fresh: kept
    _fake_owner(prefix + "tmp-d", pid=1, pid_ns="pid:[1]", heartbeat=time.time() - local_commit.STALE_S - 5)
    removed = {os.path.basename(p)[-5:] for p in sweep_dead_siblings(target)}
    assert removed == {"tmp-a", "tmp-d"}
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".json")) == [
        os.path.basename(prefix) + "tmp-b", os.path.basename(prefix) + "tmp-c"]


INNER = """
import sys, time
from merge_engine.output.local_commit import LiveFolder
with LiveFolder(sys.argv[1]) as folder:
    open(folder.path + "/shard", "w").write("live")
    print(folder.path, flush=True)
    sys.stdin.readline()
"""


def test_a_live_temp_folder_in_another_pid_namespace_survives(checkpoint, tmp_path):
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("unshare of a PID namespace is not permitted here (covered by the test above)")
    target = tmp_path / "out"
    # in the new namespace, pids start at 1: spawn a few first, as a container's processes would
    inner = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
         f"for i in $(seq 40); do true; done; exec {sys.executable} -c '{INNER}' {target}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    live = inner.stdout.readline().strip()
    try:
        assert os.path.isdir(live)
        merge_checkpoint(str(checkpoint), str(target))  # sweeps the target's siblings first
        assert os.path.isdir(live) and open(os.path.join(live, "shard")).read() == "live"
    finally:
        inner.communicate("done\n", timeout=60)
    assert not os.path.exists(live) and _whole(target)


def test_a_malformed_owner_record_beside_a_target_never_breaks_a_merge(checkpoint, tmp_path):
    """Issue 17 point 12: an owner record nested 100 000 deep (Python's parser: RecursionError) used to make
    every merge to the target a traceback. Records go through the guarded parser; a malformed one was no
    live writer's (records are written whole) and its folder is judged by the record file's age: kept
    while fresh, swept once older than STALE_S. Fields of the wrong type are the same."""
    target = tmp_path / "out"
    prefix = os.path.join(str(tmp_path), local_commit.temp_prefix(str(target)))
    _fake_owner(prefix + "tmp-nested")
    with open(prefix + "tmp-nested" + local_commit.OWNER_SUFFIX, "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    _fake_owner(prefix + "tmp-badpid", pid=10**30, heartbeat="soon")
    merge_checkpoint(str(checkpoint), str(target))  # sweeps the target's siblings first
    assert _whole(target)
    assert os.path.isdir(prefix + "tmp-nested") and os.path.isdir(prefix + "tmp-badpid")  # fresh: kept
    old = time.time() - local_commit.STALE_S - 5
    for name in ("tmp-nested", "tmp-badpid"):
        os.utime(prefix + name + local_commit.OWNER_SUFFIX, (old, old))
    removed = {os.path.basename(p).rsplit("-", 1)[-1] for p in sweep_dead_siblings(str(target))}
    assert removed == {"nested", "badpid"}
    assert not os.path.exists(prefix + "tmp-nested") and not os.path.exists(prefix + "tmp-badpid")


def test_an_owner_record_that_is_a_fifo_is_never_waited_on(tmp_path):
    """A FIFO named like an owner record: the sweep opens it non-blocking and refuses it (judged by its age)."""
    target = str(tmp_path / "out")
    prefix = os.path.join(str(tmp_path), local_commit.temp_prefix(target))
    os.makedirs(prefix + "tmp-fifo")
    os.mkfifo(prefix + "tmp-fifo" + local_commit.OWNER_SUFFIX)
    sweep = threading.Thread(target=sweep_dead_siblings, args=(target,), daemon=True)
    sweep.start()
    sweep.join(30)
    hung = sweep.is_alive()
    if hung:  # release the old code's blocking open, so the thread ends
        os.close(os.open(prefix + "tmp-fifo" + local_commit.OWNER_SUFFIX, os.O_WRONLY | os.O_NONBLOCK))
    assert not hung, "the sweep waited on a FIFO"
    assert os.path.isdir(prefix + "tmp-fifo")  # fresh: kept
