"""deployments/README.md says what the deployments really do (each claim here was once wrong).

- Idempotency per step holds for the watcher and the webhook (idempotency keys), NOT for the event
  route: a Prefect trigger keys the runs it creates per automation firing, so two notifications of
  one step can start two merge runs (which still publish once: serialised cache, publish claims).
- A notification for a step still being written is not simply "harmless": the README says what
  happens (not ready while files change; a failed run is resubmitted when the step's files change).
- A failed validation publishes nothing OF THAT OUTPUT: for a LoRA step, the merged model can be
  published before its adapter fails.
- Failed runs are resubmitted by the watcher under a documented key rule derived from the step key.
"""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "deployments" / "README.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", README, re.M | re.S)
    assert match, f"no section {title!r}"
    return match.group(1)


def test_idempotency_is_claimed_only_where_it_holds():
    assert "all idempotent" not in README
    table = {row.split("|")[1].strip(): row for row in README.splitlines() if row.startswith("| ")}
    assert "idempotency key" in table["watcher"] and "idempotency key" in table["webhook"]
    assert "not deduplicated" in table["event"] and "publishes once" in table["event"]


def test_steps_still_being_written_and_partial_lora_failures_are_described():
    assert "harmless" not in README
    assert "still being written" in README and "not ready" in README
    failures = _section("What happens when things go wrong")
    assert "LoRA" in failures and "adapter" in failures and "model release" in failures


def test_the_resubmission_key_rule_is_documented():
    rules = _section("Keys and resubmission")
    assert "{run_root}:{role}:{step}" in rules and ":after:<previous run id>" in rules
    assert "listing" in rules and "STEPMERGE_RESUBMIT_BASE_DELAY_S" in rules
