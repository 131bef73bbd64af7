"""`make ui-check`'s housekeeping (issue 20): it stops its worker the way Prefect stops (a second SIGINT)
and leaves no temp folder behind (its logs are kept beside the screenshots)."""

from __future__ import annotations

import signal
import subprocess
import sys

from deployments.ui_check import kept_logs, stop

LINGERS = """
import signal, sys
seen = []
signal.signal(signal.SIGINT, lambda *_: sys.exit(0) if seen else seen.append(1))
print("ready", flush=True)
while True:
    signal.pause()
"""


def test_a_process_that_lingers_after_one_sigint_is_stopped_by_the_second():
    child = subprocess.Popen([sys.executable, "-c", LINGERS], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    stop(child, signal.SIGINT, again_after_s=1)
    assert child.returncode == 0  # it stopped on its own (sys.exit(0) on the second SIGINT); killed: -9


def test_the_temp_folder_goes_and_the_logs_stay(tmp_path):
    work, out = tmp_path / "stepmerge-ui-check-x", tmp_path / "ui-check"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "worker.log").write_text("worker started")
    (work / "prefect").mkdir()
    out.mkdir()
    kept = kept_logs(work, work / "logs", out)
    assert not work.exists() and (kept / "worker.log").read_text() == "worker started"
