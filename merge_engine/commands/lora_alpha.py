"""The ``lora_alpha`` option in the form each adapter command reads it.

`OutputOptions.lora_alpha` holds one value (``merge``, ``extract-lora``: the one adapter of a checkpoint) or one
value per adapter (``merge-lora``). A command reads it through the function for its form, so a value of the other
form is refused by name before anything is read.
"""

from __future__ import annotations

from merge_engine.errors import AdapterError, InvalidOption
from merge_engine.output.jobs import OutputOptions

__all__ = ["lora_alpha_per_adapter", "one_lora_alpha"]


def one_lora_alpha(options: OutputOptions) -> float | None:
    """The ``lora_alpha`` of a command that reads one adapter, or None when none was given.

    Raises:
        InvalidOption: the options hold one value per adapter (``merge-lora``'s form).
    """
    alpha = options.lora_alpha
    if isinstance(alpha, tuple):
        raise InvalidOption(f"one lora_alpha is expected for a checkpoint's adapter, got one per adapter {alpha!r}")
    return alpha


def lora_alpha_per_adapter(options: OutputOptions, adapters: int) -> tuple[float | None, ...]:
    """The ``lora_alpha`` of each of ``adapters`` adapters (``merge-lora``): the values given, or None for each
    when none was given (each adapter's own config decides).

    Raises:
        InvalidOption: the options hold a single value, not one per adapter.
        AdapterError: the number of values is not the number of adapters.
    """
    alpha = options.lora_alpha
    if alpha is None:
        return (None,) * adapters
    if not isinstance(alpha, tuple):
        raise InvalidOption(f"merge-lora takes one lora_alpha per adapter (a tuple), got {alpha!r}")
    if len(alpha) != adapters:
        raise AdapterError(f"{len(alpha)} --lora-alpha values for {adapters} adapters")
    return alpha
