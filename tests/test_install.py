"""The install line the docs give for a Ray worker or node works as written (issue 20, point 5).

``pip install 'stepmerge[ray]'`` (what README and deployments/README.md said) fails: stepmerge is on
no package index, and it skipped constraints.txt. The docs now give one line, in a fenced block
tagged ``bash install`` in both files; this test reads it from the docs and runs it from the
repository root in a FRESH virtual environment. Offline and fast: the fresh environment sees the
test environment's packages through a ``.pth`` file (nothing is downloaded; ``--no-index
--no-build-isolation`` are added to pip), so what is checked is the command itself: the extra's
name, the constraints file it reads, that the package builds from the checkout and that ``stepmerge``,
Ray and prefect-ray import from the new environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "deployments/README.md")


def fenced_blocks(text: str, tag: str) -> list[str]:
    """The bodies of the fenced code blocks whose info string is ``bash <tag>``."""
    return re.findall(rf"^```bash {tag}\n(.*?)^```", text, flags=re.M | re.S)


def install_lines() -> list[str]:
    lines = []
    for doc in DOCS:
        for block in fenced_blocks((ROOT / doc).read_text(), "install"):
            lines += [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    return lines


def test_both_docs_give_the_same_ray_install_line_with_the_constraints():
    lines = install_lines()
    assert len(lines) == 2 and len(set(lines)) == 1, lines
    words = shlex.split(lines[0])
    assert words[:2] == ["pip", "install"] and "constraints.txt" in words and ".[ray]" in words
    assert "stepmerge[ray]" not in (ROOT / "README.md").read_text() + (ROOT / "deployments/README.md").read_text()


def test_the_documented_ray_install_works_in_a_fresh_venv(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV", "VIRTUAL_ENV")}
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # no pip or setuptools of its own: the test env's are seen
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "test-env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    source = tmp_path / "checkout"  # a copy: the build leaves build/ and *.egg-info where it runs
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "build", "*.egg-info",
                                                                "demo", "ui-check", ".bench", ".whl", "tests"))
    (line,) = set(install_lines())
    words = shlex.split(line)
    assert words[0] == "pip"
    command = [str(python), "-m", *words, "--no-index", "--no-build-isolation", "--disable-pip-version-check", "-q"]
    done = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    check = subprocess.run([str(env_dir / "bin" / "stepmerge"), "--version"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=120, env=env)
    assert check.returncode == 0 and check.stdout.startswith("stepmerge "), check.stderr[-2000:]
    where = subprocess.run([str(python), "-c", "import merge_engine, ray, prefect_ray; print(merge_engine.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.strip().startswith(str(env_dir)), where.stdout  # installed there, not found elsewhere
    assert sys.prefix != str(env_dir)
