"""Markdown for the Prefect UI: one artifact per merged step, one per watcher run.

Pure functions from outcome records to markdown strings (the flows create the artifacts), so
what the UI shows is testable without a server.
"""

from typing import Iterable, List, Optional

from flows.outcomes import StageRun, StepOutcome


def human_size(n: float) -> str:
    """``n`` bytes in decimal units: ``812 B``, ``1.5 MB``, ``4.9 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def stage_table(stages: Iterable[StageRun]) -> List[str]:
    lines = ["| stage | state | seconds |", "|---|---|---:|"]
    lines += [f"| {s.name} | {s.state} | {s.seconds:.2f} |" for s in stages]
    return lines


def step_summary(outcome: StepOutcome, error: Optional[str] = None) -> str:
    """The markdown artifact of one merge_step run."""
    role = outcome.role or "(no role: SFT)"
    lines = [f"# Step {outcome.step} of `{outcome.run_root}` — {role}", ""]
    if error is not None:
        lines += [f"**Failed**: {error}", "", "Nothing was published for the failed stage.", ""]
    elif outcome.status == "not_ready":
        lines += [f"**Not ready yet**: {outcome.reason}.", "", "Nothing was merged in this run.", ""]
    else:
        verdict = "cache hit: nothing was read or written" if outcome.cached else outcome.status.replace("_", " ")
        lines += [f"**{verdict}** in {outcome.seconds:.1f} s", ""]
    if outcome.releases:
        lines += ["| output | release | tensors | bytes | validation | new |", "|---|---|---:|---:|---|---|"]
        for r in outcome.releases:
            ok = {True: "passed", False: "**FAILED**", None: "not run"}[r.validation_ok]
            size = human_size(r.tensor_bytes or r.total_bytes)
            lines.append(f"| {r.kind} | `{r.url}` | {r.tensors} | {size} | {ok} | "
                         f"{'no' if r.already_published else 'yes'} |")
        lines.append("")
    if outcome.pushes:
        lines += ["## Hugging Face Hub", "", "| output | repo | revision | commit | new commit |", "|---|---|---|---|---|"]
        for p in outcome.pushes:
            if p.error:
                lines.append(f"| {p.kind} | `{p.repo}` | | **push failed**: {p.error} | |")
                continue
            refs = f" (+ {', '.join(p.moved_refs)})" if p.moved_refs else ""
            lines.append(f"| {p.kind} | `{p.repo}` | `{p.revision}`{refs} | `{p.commit[:12]}` | "
                         f"{'yes' if p.committed else 'no (already there)'} |")
        lines.append("")
    if outcome.registrations:
        lines += ["## MLflow Model Registry", "", "| output | model | version | new version |", "|---|---|---|---|"]
        for g in outcome.registrations:
            if g.error:
                lines.append(f"| {g.kind} | `{g.name}` | **registration failed**: {g.error} | |")
                continue
            lines.append(f"| {g.kind} | `{g.name}` | {g.version} | {'yes' if g.created else 'no (already there)'} |")
        lines.append("")
    if outcome.stages:
        lines += ["## Stages", ""] + stage_table(outcome.stages) + [""]
    for r in outcome.releases:
        if r.validation_summary:
            lines += [f"## Validation of the {r.kind}", "", r.validation_summary, ""]
    return "\n".join(lines)


def named_detail(row: dict) -> str:
    """A row's detail with its flow run shown by NAME, linked to the run's page (``flow run <id>`` -> the
    run's name as a link): the artifact reads ``exp1 actor step 40``, not a bare id."""
    run_id, name, detail = row.get("flow_run_id") or "", row.get("flow_run_name") or "", row.get("detail", "")
    if not run_id:
        return detail
    link = f"[{name or run_id}](/runs/flow-run/{run_id})"
    return detail.replace(f"flow run {run_id}", link) if f"flow run {run_id}" in detail else f"{link} {detail}"


def watch_summary(run_root: str, rows: List[dict], waiting: List[str], seconds: float,
                  published_steps: int = 0, releases: int = 0) -> str:
    """The markdown artifact of one merge_new_steps run (``rows``: step, role, action, detail; a
    submitted step's detail names its run and links to it); ``published_steps`` counts steps, not
    releases (a LoRA step has two)."""
    handled = f"{len(rows)} step(s) handled in {seconds:.1f} s"
    before = f"; {published_steps} step(s) already published ({releases} release(s))" if releases else ""
    lines = [f"# New steps of `{run_root}`", "", f"{handled}{before}.", ""]
    if rows:
        lines += ["| step | role | action | detail |", "|---:|---|---|---|"]
        lines += [f"| {r['step']} | {r['role'] or '-'} | {r['action']} | {named_detail(r)} |" for r in rows]
        lines.append("")
    if waiting:
        lines += ["Not ready yet (still being written, or incomplete): " + ", ".join(waiting), ""]
    return "\n".join(lines)
