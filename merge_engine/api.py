"""The Python API: what ``stepmerge merge``, ``extract-lora``, ``merge-lora``, ``check`` and ``verify`` do, and
publishing a merged folder as a release, as typed functions (``import merge_engine``; docs/python.md).

Each is a thin call into the engine's commands and release modules with the same options record the CLI builds
(`merge_engine.output.jobs.OutputOptions`). Nothing heavy is imported until a function runs, so ``import
merge_engine`` stays cheap. Failures raise the engine's named errors (`merge_engine.errors`), each carrying the
path at fault.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from merge_engine.layouts import Checkpoint
    from merge_engine.output.jobs import OutputOptions, OutputResult
    from merge_engine.release.publish import Release
    from merge_engine.release.verify import VerifyReport

__all__ = ["check", "extract_lora", "merge", "merge_lora", "publish", "verify"]


def _options(options: OutputOptions | None) -> OutputOptions:
    from merge_engine.output.jobs import OutputOptions

    return OutputOptions() if options is None else options


def merge(source: str, target: str, options: OutputOptions | None = None, *,
          on_bytes: Callable[[int], None] | None = None) -> OutputResult:
    """Merge a training checkpoint into a Hugging Face model folder (``stepmerge merge``).

    Args:
        source: URL or path of one step's checkpoint (``global_step_N/actor``, ``iter_0000100``, ...); its layout
            is recognised from the file listing.
        target: URL or path of the folder to write (``file://``, ``s3://``, ``gs://`` or a local path).
        options: the output options (dtype, shard size, ``hf_model_path``, ``overwrite``, ...); default: none set.
        on_bytes: called with the number of bytes written as the shards are written (a progress bar).

    Returns:
        `OutputResult`: the target, the layout read, tensors and bytes written, each file's sha256, and
        ``skipped=True`` when the target already held this very merge.

    Raises:
        IncompleteCheckpoint: a file is missing or short, or the rank files disagree.
        CorruptShard: a file cannot be read safely (unsafe pickle, bad header, CRC mismatch).
        UnsupportedLayout: the folder is no checkpoint layout stepmerge reads.
        TargetExists: the target holds another output and ``options.overwrite`` is not set.
    """
    from merge_engine.commands.merge import merge_checkpoint

    return merge_checkpoint(source, target, _options(options), on_bytes=on_bytes)


def extract_lora(source: str, target: str, options: OutputOptions | None = None) -> OutputResult:
    """Write a LoRA training step's adapter as a PEFT folder (``stepmerge extract-lora --local_dir``).

    Args:
        source: URL or path of a LoRA step's checkpoint.
        target: URL or path of the PEFT adapter folder to write.
        options: the output options (``lora_alpha``, ``include_base``, ``base_model``, dtype, ...).

    Returns:
        `OutputResult` of the adapter (``kind="adapter"``).

    Raises:
        AdapterError: the step holds no LoRA factors, or their ranks or alpha cannot be told.
        IncompleteCheckpoint: a file is missing or short.
        TargetExists: the target holds another output and ``options.overwrite`` is not set.
    """
    from merge_engine.commands.extract import extract_lora as extract

    return extract(source, target, _options(options))


def merge_lora(base: str | None, adapters: Sequence[str], target: str,
               options: OutputOptions | None = None) -> OutputResult:
    """Fuse PEFT adapters into a base model, or combine them into one adapter (``stepmerge merge-lora``).

    Args:
        base: URL or path of the base model folder (None only when ``options.output == "adapter"``).
        adapters: URLs or paths of PEFT adapter folders, in order.
        target: URL or path of the folder to write.
        options: ``output`` ("model" or "adapter"), ``method``, ``weights``, dtype, ...

    Returns:
        `OutputResult` of the fused model or the combined adapter.

    Raises:
        AdapterError: an adapter does not fit the base or the others.
        BaseModelRequired: a fused model was asked for without ``base``.
        TargetExists: the target holds another output and ``options.overwrite`` is not set.
    """
    from merge_engine.commands.combine import merge_lora as combine

    return combine(base, list(adapters), target, _options(options))


def check(source: str, *, backend: str | None = None) -> Checkpoint:
    """Check that a checkpoint is complete and readable, without reading its weights (``stepmerge check``).

    Args:
        source: URL or path of one step's checkpoint.
        backend: the layout to read it as (``fsdp``, ``megatron_dist``, ...); default: recognised from the listing.

    Returns:
        `Checkpoint`: its layout, files, parallel sizes and content fingerprint.

    Raises:
        IncompleteCheckpoint: a file is missing or short (training still writing it), or ranks disagree.
        CorruptShard: a file is there but cannot be read.
        UnsupportedLayout: the folder is no checkpoint layout stepmerge reads.
    """
    from merge_engine.layouts import check_checkpoint

    return check_checkpoint(source, backend)


def verify(url: str, *, quick: bool = False) -> VerifyReport:
    """Verify a release or a merged folder against its manifest or ``stepmerge.json`` (``stepmerge verify``).

    Args:
        url: URL or path of a release (``manifest.json`` + ``_COMPLETE``) or of a folder stepmerge wrote.
        quick: compare sizes and the store's recorded versions only; default: hash every file (sha256).

    Returns:
        `VerifyReport` of an intact folder: files checked, bytes hashed, the method used.

    Raises:
        ReleaseIncomplete: a release without a valid ``_COMPLETE`` marker.
        ReleaseDamaged: a file is missing, resized or rewritten (each one named).
        InvalidConfig: there is nothing to verify against.
    """
    from merge_engine.release.verify import raise_for, verify_folder

    report = verify_folder(url, mode="quick" if quick else "full")
    raise_for(report)
    return report


def publish(merged: OutputResult, release: str, options: OutputOptions | None = None, *,
            overwrite: bool = False) -> Release:
    """Publish a folder that `merge`, `extract_lora` or `merge_lora` wrote as a release, atomically: its files
    copied and checked against the sha256 the writer recorded, then ``manifest.json``, then ``_COMPLETE``.

    Args:
        merged: the result of the call that wrote the folder (its target is published, then removed).
        release: URL or path of the release folder (``<release root>/<name>/global_step_N``).
        options: the options that call was given, recorded in the manifest; default: none set.
        overwrite: replace a release of another build; default: refuse it.

    Returns:
        `Release`: the release's URL and manifest.

    Raises:
        TargetExists: the release holds another build and ``overwrite`` is not set.
        ChecksumMismatch: a staged file differs from what the writer recorded (nothing published).
        InvalidOption: the folder is empty, or the folder and the release lie inside each other.
    """
    import merge_engine
    from merge_engine.release.publish import publish as publish_folder

    recorded = _options(options).output_options(merged.command)
    return publish_folder(merged.target_url, release, source=merged.source_url, fingerprint=merged.fingerprint,
                          options=recorded, validation=None, engine_version=merge_engine.__version__,
                          overwrite=overwrite, checksums=dict(merged.checksums))
