"""The transformers / peft releases stepmerge is tested with, and the start-up check against them.

Contract:
- `TESTED`: the tested pairs, one row each (a transformers range, the peft range tested with it, the
  environments of the compatibility matrix that test it: ``make compat``, `tests.compat_matrix`).
  pyproject's ranges are these rows' union; the README's table is this one.
- `installed_versions()`: the installed transformers and peft versions, read from their distributions'
  metadata (``importlib.metadata``): nothing is imported, so a command that needs neither stays quick.
- `unsupported_reason(versions)`: None when the pair is in one row of `TESTED`, else one line naming
  the installed versions and every tested range.
- `require_tested_versions()`: raises `UnsupportedVersions` with that line (the CLI prints it, exit 1);
  ``STEPMERGE_UNTESTED_VERSIONS=1`` lets a user run an untested pair anyway (every output is still
  validated by that environment's transformers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from merge_engine.errors import UnsupportedVersions

OVERRIDE_ENV = "STEPMERGE_UNTESTED_VERSIONS"


@dataclass(frozen=True)
class TestedPair:
    """transformers in [``transformers_from``, ``transformers_below``) with peft in [``peft_from``, ``peft_below``)."""

    transformers_from: str
    transformers_below: str
    peft_from: str
    peft_below: str
    tested_with: str  # the matrix's environments for this row

    def holds(self, transformers: str, peft: str) -> bool:
        """A release (never a pre-release, nor an unparsable version) inside both ranges."""
        return (_within(transformers, self.transformers_from, self.transformers_below)
                and _within(peft, self.peft_from, self.peft_below))

    def describe(self) -> str:
        return (f"transformers >={self.transformers_from},<{self.transformers_below} with "
                f"peft >={self.peft_from},<{self.peft_below}")


TESTED: tuple[TestedPair, ...] = (
    # transformers 4.x: the Hub's names are the model's, no conversion mapping, 4.x rope keys
    TestedPair("4.57", "4.58", "0.17", "0.18", "transformers 4.57.6 + peft 0.17.1"),
    # what pip resolves beside 4.57 when peft is not pinned (pyproject admits peft <0.22)
    TestedPair("4.57", "4.58", "0.21", "0.22", "transformers 4.57.6 + peft 0.21.2"),
    # verl 0.9.1's range (5.5.3-5.10), the CUDA images' 5.17, the newest
    TestedPair("5.5.3", "5.26", "0.18", "0.22", "transformers 5.5.3 + peft 0.18.1, 5.10.4 + 0.19.1, "
                                                "5.17.0 + 0.21.0, 5.25.0 + 0.21.2"),
)


def _within(version: str, lowest: str, below: str) -> bool:
    try:
        parsed = Version(version)
        # pre- and dev releases are never tested (packaging's contains would admit some: 5.25.1a1 < 5.26)
        return not (parsed.is_prerelease or parsed.is_devrelease) \
            and SpecifierSet(f">={lowest},<{below}").contains(parsed, prereleases=False)
    except (InvalidVersion, InvalidSpecifier):
        return False


def installed_versions() -> dict[str, str | None]:
    """``{"transformers": ..., "peft": ...}`` from the installed distributions' metadata (None: not installed)."""
    found: dict[str, str | None] = {}
    for name in ("transformers", "peft"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def supported_ranges() -> str:
    return "; or ".join(pair.describe() for pair in TESTED)


def unsupported_reason(versions: dict[str, str | None]) -> str | None:
    """None when ``versions`` is a tested pair (see the module docstring), else why not, in one line."""
    transformers, peft = versions.get("transformers"), versions.get("peft")
    if transformers and peft and any(pair.holds(transformers, peft) for pair in TESTED):
        return None
    installed = f"transformers {transformers or '(not installed)'} with peft {peft or '(not installed)'}"
    return (f"{installed} is not a tested pair; stepmerge is tested with {supported_ranges()} "
            f"(install one of those, or set {OVERRIDE_ENV}=1 to run untested)")


def require_tested_versions() -> None:
    """`UnsupportedVersions` unless the installed pair is tested (or ``STEPMERGE_UNTESTED_VERSIONS=1``)."""
    if os.environ.get(OVERRIDE_ENV, "").strip() in ("1", "true", "yes"):
        return
    reason = unsupported_reason(installed_versions())
    if reason is not None:
        raise UnsupportedVersions(reason)
