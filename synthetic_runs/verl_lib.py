"""verl 0.9.1 itself, importable by the synthetic writer's ranks: its files and the modules its checkpoint
manager imports, installed once per machine with ``pip install --target`` (no dependency resolution: torch,
transformers, peft, accelerate and numpy stay the project's own) into ``STEPMERGE_VERL_LIB`` (default: the
machine's stepmerge cache, ``$STEPMERGE_CACHE`` or ``~/.cache/stepmerge``, shared by every checkout; one build
at a time under a file lock, moved into place when it imports).

verl 0.9.1 declares ``transformers>=5.5.3,<5.11``; its ``FSDPCheckpointManager`` is imported and run here
with the project's transformers (5.24) and peft (0.21). `verl_lib_dir` installs on first use and raises
`VerlUnavailable` (with pip's output) when it cannot.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERL = "verl==0.9.1"
# what `import verl.utils.checkpoint.fsdp_checkpoint_manager` needs beyond the project's own packages
IMPORTED = ("tensordict", "pyvers", "omegaconf", "antlr4-python3-runtime==4.9.3", "hydra-core", "codetiming",
            "datasets", "multiprocess", "dill", "xxhash", "pandas", "pyarrow", "pillow")
PROBE = "import verl.utils.checkpoint.fsdp_checkpoint_manager"
MARKER = ".installed"


def default_dir() -> Path:
    root = Path(os.environ.get("STEPMERGE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "stepmerge")
    key = "\n".join((VERL, *IMPORTED, sys.version))
    return root / f"verl-lib-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


class VerlUnavailable(RuntimeError):
    """verl 0.9.1 could not be installed or imported here; the message says why."""


def _importable(target: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p),
           "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)


def verl_lib_dir() -> str:
    """The folder to put on PYTHONPATH for ``import verl`` (installed on first use; `VerlUnavailable`)."""
    target = Path(os.environ.get("STEPMERGE_VERL_LIB") or default_dir())
    if (target / MARKER).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / (target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session installing it: wait for it
        if (target / MARKER).exists():
            return str(target)
        staging = target.parent / (target.name + f".building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            install = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                                      "--no-deps", "--target", str(staging), VERL, *IMPORTED],
                                     capture_output=True, text=True)
            if install.returncode != 0:
                raise VerlUnavailable(f"pip could not install {VERL}: {install.stderr[-2000:]}")
            probe = _importable(staging)
            if probe.returncode != 0:
                raise VerlUnavailable(f"{VERL} does not import here: {probe.stderr[-2000:]}")
            (staging / MARKER).write_text(VERL + "\n")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)
