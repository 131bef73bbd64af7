"""`make ui-check`'s housekeeping: it stops its worker the way Prefect stops (a second SIGINT), leaves no temp
folder behind (its logs are kept beside the screenshots) and writes the README's two images small."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from deployments.ui_check import README_IMAGE_BYTES, README_IMAGES, kept_logs, readme_images, stop

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


def test_the_readme_images_are_the_tops_of_the_screenshots_scaled_down(tmp_path):
    """A 1600 x 2600 screenshot becomes a 1000 x 1100 image of its top; one of noise (incompressible) is scaled
    down further until it is under README_IMAGE_BYTES."""
    import os

    from PIL import Image

    out, repo = tmp_path / "ui-check", tmp_path / "repo"
    out.mkdir()
    (form, summary), (form_target, summary_target) = README_IMAGES, README_IMAGES.values()
    page = Image.new("RGB", (1600, 2600), "white")
    page.paste((30, 60, 200), (100, 100, 900, 300))
    page.save(out / form)
    Image.frombytes("RGB", (1600, 2600), os.urandom(1600 * 2600 * 3)).save(out / summary)
    written = readme_images(out, repo)
    assert written == [repo / form_target, repo / summary_target]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for path in written:
        assert path.stat().st_size < README_IMAGE_BYTES, path.stat().st_size
        assert f"({path.relative_to(repo)})" in readme, f"README does not show {path.relative_to(repo)}"
    with Image.open(repo / form_target) as small, Image.open(repo / summary_target) as noise:
        assert small.size == (1000, 1100) and small.getpixel((100, 100)) != small.getpixel((900, 900))
        assert noise.width < 1000 and abs(noise.width / noise.height - 1000 / 1100) < 0.01
