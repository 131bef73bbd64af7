"""A second Python environment for tests: the readers of the transformers 4.x era (transformers 4.57,
peft 0.17), to check that what stepmerge writes loads there too.

Contract:
- `readers_python()` returns the interpreter of that environment, building it first if this machine
  has none: a venv under the cache folder (``$STEPMERGE_CACHE``, else ``$XDG_CACHE_HOME/stepmerge``,
  else ``~/.cache/stepmerge``) named by a digest of `PINS`, the Python version and the main
  environment's path. Its own site-packages hold only `PINS` (installed from the package registries
  with ``pip --target --no-deps``); a ``.pth`` file, read after them, appends the main environment's
  site-packages, so torch, safetensors and the rest are the main environment's, and transformers,
  peft, tokenizers and huggingface_hub are the pinned ones (4.57 needs huggingface_hub < 1.0).
- The main environment is never written to (``--target`` installs only into the new folder).
- Built under a file lock (parallel test sessions wait for one build), into a temporary folder
  renamed into place once every pinned package's requirements are met (checked with
  ``importlib.metadata`` inside it): a half-built environment is never used. `ReadersEnvError`
  carries pip's or the check's output when the build fails.
- `pinned_python(name, pins)`: the same for any pins (`tests.compat_matrix`'s environments), under
  ``<name>-<digest>``; pip runs with ``-c constraints.txt`` and ``--no-deps``, so torch is never installed there.
- ``python -m tests.readers_env`` builds it (``make test`` runs this first) and prints where and how long.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PINS = ("transformers==4.57.6", "peft==0.17.1", "tokenizers==0.22.2", "huggingface_hub==0.36.2")
READY = ".stepmerge-readers-ready"
MAIN_PTH = "zz_stepmerge_main_env.pth"
CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"  # the CPU torch pin: never a CUDA build  # after the pinned packages in sys.path (site reads .pth files in order)

# Run inside the new environment: every requirement of the pinned distributions is met there.
_CHECK = r"""
import importlib.metadata as md, sys
from packaging.requirements import Requirement
bad = []
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    if md.version(name) != version:
        bad.append(f"{name} is {md.version(name)}, not {version}")
    for text in md.requires(name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            found = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{name} needs {req}: not installed"); continue
        if not req.specifier.contains(found, prereleases=True):
            bad.append(f"{name} needs {req}: found {found}")
import transformers, peft
print(transformers.__version__, peft.__version__)
sys.exit("\n".join(bad) if bad else 0)
"""


class ReadersEnvError(RuntimeError):
    """The readers' environment could not be built; the message carries the failing command's output."""


def cache_root() -> Path:
    if os.environ.get("STEPMERGE_CACHE"):
        return Path(os.environ["STEPMERGE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stepmerge"


def env_dir(name: str = "readers", pins: tuple[str, ...] = PINS) -> Path:
    """The cache folder of the environment ``name`` holding ``pins`` (keyed by them, the Python and the main
    environment)."""
    main_site = sysconfig.get_paths()["purelib"]
    key = "\n".join((*pins, sys.version, main_site))
    return cache_root() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _python(folder: Path) -> Path:
    return folder / "bin" / "python"


def _run(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReadersEnvError(f"{what} failed ({done.returncode}): {' '.join(command)}\n{done.stdout[-4000:]}"
                              f"\n{done.stderr[-4000:]}")
    return done.stdout


def _build(folder: Path, pins: tuple[str, ...]) -> None:
    _run([sys.executable, "-m", "venv", "--without-pip", str(folder)], "creating the venv")
    site = Path(_run([str(_python(folder)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     "locating its site-packages").strip())
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
          "--no-compile", "-c", str(CONSTRAINTS), "--target", str(site), *pins], "pip install " + " ".join(pins))
    (site / MAIN_PTH).write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(_python(folder)), "-c", _CHECK, *pins], "checking the pinned packages' requirements")


def readers_python() -> Path:
    """The readers' interpreter (see the module docstring), built on first use."""
    return pinned_python("readers", PINS)


def pinned_python(name: str, pins: tuple[str, ...]) -> Path:
    """The interpreter of the environment ``name`` with ``pins`` over the main one (the module docstring's
    contract, for any pins), built on first use."""
    folder = env_dir(name, pins)
    if (folder / READY).exists():
        return _python(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / (folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building it: wait for it
        if (folder / READY).exists():
            return _python(folder)
        staging = folder.parent / (folder.name + f".building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _build(staging, pins)
            # venv scripts name their folder: build at the final path's sibling, then move the whole tree
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        (folder / READY).write_text("\n".join(pins) + "\n")
    return _python(folder)


def main() -> int:
    started = time.perf_counter()
    existed = (env_dir() / READY).exists()
    python = readers_python()
    print(f"readers env ({', '.join(PINS)}): {python.parent.parent} "
          f"({'cached' if existed else f'built in {time.perf_counter() - started:.1f} s'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
