"""The result of validation: named `Check`s in a `ValidationReport` (what publish stores and the UI shows).

A failed check is a result, not an exception: only `ValidationReport.raise_for_failure` raises
(`ValidationFailed`, naming the first failed check).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from merge_engine.errors import ValidationFailed


@dataclass(frozen=True)
class Check:
    """One named check: passed or not, and what a person needs to know (the failing key, the size).

    ``skipped``: the check could not run here (``ok`` stays True so it does not block a publish, but the
    summary says SKIP and why: a skipped check is never shown as passed)."""

    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


@dataclass(frozen=True)
class ValidationReport:
    """The checks run on one model folder; `ok` when every check passed (and at least one ran)."""

    model_url: str
    checks: tuple[Check, ...] = ()
    reference_url: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def check(self, name: str) -> Check | None:
        """The check called `name`, or None if it did not run."""
        return next((c for c in self.checks if c.name == name), None)

    def extended(self, other: ValidationReport) -> ValidationReport:
        """This report followed by the checks of `other` (same model)."""
        return ValidationReport(self.model_url, self.checks + other.checks, self.reference_url or other.reference_url)

    def summary(self) -> str:
        """Markdown: a verdict line, then one bullet per check."""
        passed = sum(c.ok and not c.skipped for c in self.checks)
        skipped = sum(c.skipped for c in self.checks)
        verdict = "PASSED" if self.ok else "FAILED"
        lines = [f"**Validation {verdict}** ({passed}/{len(self.checks)} checks"
                 + (f", {skipped} skipped" if skipped else "") + f") of `{self.model_url}`"]
        if self.reference_url:
            lines.append(f"against reference `{self.reference_url}`")
        lines.append("")
        for c in self.checks:
            verdict = "SKIP" if c.skipped else ("PASS" if c.ok else "**FAIL**")
            lines.append(f"- {verdict} `{c.name}`" + (f": {c.detail}" if c.detail else ""))
        return "\n".join(lines)

    def text(self) -> str:
        """Plain text for a terminal (`summary` is Markdown, for the UI): a verdict line, one line per check."""
        passed = sum(c.ok and not c.skipped for c in self.checks)
        skipped = sum(c.skipped for c in self.checks)
        verdict = "passed" if self.ok else "FAILED"
        against = f" against reference {self.reference_url}" if self.reference_url else ""
        counts = f"{passed}/{len(self.checks)} checks" + (f", {skipped} skipped" if skipped else "")
        lines = [f"validation {verdict} ({counts}) of {self.model_url}{against}"]
        lines += [f"  {'SKIP' if c.skipped else ('PASS' if c.ok else 'FAIL')} {c.name}"
                  + (f": {c.detail}" if c.detail else "") for c in self.checks]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ok, urls and every check."""
        return {
            "ok": self.ok,
            "model_url": self.model_url,
            "reference_url": self.reference_url,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, **({"skipped": True} if c.skipped else {})}
                       for c in self.checks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationReport:
        checks = tuple(Check(c["name"], bool(c["ok"]), c.get("detail", ""), bool(c.get("skipped", False)))
                       for c in data.get("checks", ()))
        return cls(data["model_url"], checks, data.get("reference_url"))

    def raise_for_failure(self) -> None:
        """Raise `ValidationFailed` naming the first failed check; nothing when the report is ok."""
        if not self.ok:
            first = self.failures[0] if self.failures else Check("checks", False, "no check ran")
            raise ValidationFailed(f"validation failed: {first.name}: {first.detail}", self.model_url)
