"""The Hub revision a step is pushed to: a template filled with the step and the role, checked as a git ref name.

- A template names its revision with the placeholders ``{step}`` (the step number, a format spec allowed:
  ``iter_{step:07d}``) and ``{role}`` (the checkpoint's role, ``sft`` for a run without roles); no other
  placeholder. Default: ``step-{step}``.
- Filled, it must be a branch name git and the Hub accept (`ref_problem`): letters, digits and ``._/-``; no
  component starting with ``.`` or ending with ``.lock``; no ``..``, ``//``, leading or trailing ``/``; not ``@``,
  ``HEAD`` or a 40-hex name (it would read as a commit id).
- An adapter release goes to its model's revision with ``-adapter`` appended (``step-3-adapter``), and so do its
  moving refs (``latest-adapter``): one repo holds a step's model and adapter on two branches.
"""

from __future__ import annotations

import re
import string

from merge_engine.errors import InvalidOption

DEFAULT_REVISION_TEMPLATE = "step-{step}"
PLACEHOLDERS = ("step", "role")
ADAPTER_SUFFIX = "-adapter"
MAX_REF_LENGTH = 200
_REF_CHARS = re.compile(r"^[A-Za-z0-9._/-]+$")
_COMMIT_ID = re.compile(r"^[0-9a-fA-F]{40}$")


def ref_problem(name: str) -> str | None:
    """Why ``name`` is no branch name git and the Hub accept (see the module docstring); None when it is one."""
    if not name:
        return "it is empty"
    if len(name) > MAX_REF_LENGTH:
        return f"it is longer than {MAX_REF_LENGTH} characters"
    if not _REF_CHARS.match(name):
        return "only letters, digits and . _ / - may be used"
    if name in ("@", "HEAD") or _COMMIT_ID.match(name):
        return "it would read as a commit, not a branch"
    if name.startswith("/") or name.endswith("/") or "//" in name or ".." in name:
        return "no leading, trailing or doubled / and no .."
    if any(part.startswith(".") or part.endswith(".lock") for part in name.split("/")) or name.endswith("."):
        return "no part may start with . or end with .lock or ."
    return None


def template_problem(template: str) -> str | None:
    """Why ``template`` is no revision template (see the module docstring); None when it is one."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return f"it is not a template ({exc})"
    unknown = sorted({name for name in fields if name not in PLACEHOLDERS})
    if unknown:
        return f"only the placeholders {{step}} and {{role}} may be used, not {', '.join('{%s}' % n for n in unknown)}"
    try:
        filled = template.format(step=0, role="actor")
    except (ValueError, IndexError, KeyError) as exc:
        return f"it cannot be filled ({exc})"
    problem = ref_problem(filled)
    return None if problem is None else f"filled ({filled}) it is no branch name: {problem}"


def checked_template(template: str) -> str:
    """``template`` when it is a revision template (see the module docstring). Raises `InvalidOption`."""
    problem = template_problem(template)
    if problem:
        raise InvalidOption(f"revision template {template!r}: {problem}")
    return template


def checked_ref(name: str) -> str:
    """``name`` when it is a branch name (a moving ref such as ``latest``). Raises `InvalidOption`."""
    problem = ref_problem(name)
    if problem:
        raise InvalidOption(f"Hub ref {name!r}: {problem}")
    return name


def revision_for(template: str, step: int, role: str, adapter: bool = False) -> str:
    """The revision of ``step`` (``role``; empty: ``sft``): ``template`` filled, ``-adapter`` appended for an adapter
    release. Raises `InvalidOption` when the template or the name it gives is refused."""
    name = checked_template(template).format(step=step, role=role or "sft") + (ADAPTER_SUFFIX if adapter else "")
    return checked_ref(name)


def moving_refs_for(refs: tuple[str, ...] | list[str], adapter: bool = False) -> tuple[str, ...]:
    """The moving refs of a release (``latest`` -> ``latest-adapter`` for an adapter), each checked."""
    return tuple(checked_ref(ref + (ADAPTER_SUFFIX if adapter else "")) for ref in refs)


__all__ = ["DEFAULT_REVISION_TEMPLATE", "PLACEHOLDERS", "checked_ref", "checked_template", "moving_refs_for",
           "ref_problem", "revision_for", "template_problem"]
