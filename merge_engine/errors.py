"""The errors a user of stepmerge can cause, each naming the path at fault.

Every error here is *permanent*: retrying the same call gives the same error. The CLI maps
them to one line on stderr and a non-zero exit code; the Prefect tasks map them to a failed,
not retried, task. Transient storage faults are not wrapped: they surface as the storage
library's own exceptions (see `merge_engine.storage.is_transient`).
"""

from __future__ import annotations


def one_line(value: object, limit: int = 120) -> str:
    """``value``'s text as one bounded line, for a message that echoes what a user or a file gave: characters
    that are not printable (newline, U+202E) escaped as ``repr`` writes them, at most ``limit`` characters kept
    (how many more there were is said)."""
    text = str(value)
    cut = text[:limit]
    shown = cut if cut.isprintable() else repr(cut)[1:-1]
    return shown if len(text) <= limit else f"{shown}... ({len(text) - limit} more characters)"


class StepmergeError(Exception):
    """Base class. `path` is the file or folder at fault (a URL or a local path); the message shows it as one
    bounded line (`one_line`)."""

    exit_code = 2

    def __init__(self, message: str, path: str | None = None) -> None:
        self.message = message
        self.path = path
        super().__init__(f"{message} [{one_line(path, 1200)}]" if path else message)


class IncompleteCheckpoint(StepmergeError):
    """A file the layout requires is missing, empty, or still being written."""

    exit_code = 3


class WorldSizeMismatch(IncompleteCheckpoint):
    """The rank files disagree with each other or with the recorded world / parallel sizes."""


class SourceChanged(IncompleteCheckpoint):
    """A source file changed after its listing was taken (replaced, rewritten or resized while the job
    ran): its reads are pinned to the version listed (S3 ETag, GCS generation, local inode + size +
    mtime), so the bytes read are exactly those the fingerprint names, or this is raised and nothing
    is written. Running again reads (and fingerprints) the new version."""


class CorruptShard(StepmergeError):
    """A file exists but cannot be read: truncated, not a zip, bad header, inconsistent shards."""

    exit_code = 4


class AliasedTensors(CorruptShard):
    """Several names share one stored tensor's bytes where the config ties none of them: each would be
    written whole, so the output would exceed what the input's distinct bytes justify; refused."""


class UnsafePickle(CorruptShard):
    """A pickle asks for a callable outside the allow-list; it was not run."""


class UnsafeRecord(CorruptShard):
    """A record carried between tasks or processes (a checkpoint's tensor index, a cached task result) is
    not one the engine writes: a type outside the exact table, a field of the wrong kind, a size past its
    bound, or a URL outside the checkpoint it describes. It was refused before anything in it was run,
    imported or read; ``path`` is the checkpoint or result record at fault."""


class ForgedRecord(UnsafeRecord):
    """A cached record, well formed and naming places inside what it describes, states facts other than the
    thing it names does when checked again (another checkpoint of the step, another layout, other parallel sizes,
    another build's fingerprint or settings): it is not used, and the flow computes it again; ``path`` is the
    place the record names."""


class UnsupportedLayout(StepmergeError):
    """No layout recognises the folder, or a layout feature is not supported."""


class UnknownArchitecture(StepmergeError):
    """The model family has no name table; the message lists the supported families."""


class MappingError(StepmergeError):
    """A name table left a tensor unmapped, mapped one twice, or produced an unexpected shape."""


class InvalidConfig(StepmergeError):
    """config.json (or another metadata file) is missing, unparsable, or contradicts the weights."""


class TargetExists(StepmergeError):
    """The target already holds a different model (or is a file) and `overwrite` was not given."""


class UnsafeFile(CorruptShard):
    """An input holds a symbolic link leaving its folder, or something that is not a regular file
    (a device, a FIFO, a socket), or a file larger than its kind allows: it is never read or copied."""


class ReleaseIncomplete(IncompleteCheckpoint):
    """The folder has no valid ``_COMPLETE`` marker: it is not a release readers may trust."""


class ChecksumMismatch(CorruptShard):
    """A file's bytes differ from the sha256 its writer computed while writing it (a staged shard
    changed between the merge and the publish); nothing is published."""


class ReleaseDamaged(StepmergeError):
    """A release (or a merged folder with a manifest) differs from its manifest: a file is missing,
    resized, has other bytes, or is not listed; the message names each bad file."""

    exit_code = 6


class HubPushRefused(StepmergeError):
    """A push to the Hugging Face Hub was refused before anything was committed: no token, a token the Hub refuses,
    no write access, no such repo (and none to be created), or the Hub out of reach. ``path``: the repo.
    ``transient``: the Hub was out of reach or answered 429 / 5xx, so the same push may succeed later."""

    transient = False


class RegistryRefused(StepmergeError):
    """Registering a release in MLflow's Model Registry was refused: no MLflow client, a release on local disk (no
    reference MLflow takes), or the tracking server out of reach or refusing. ``path``: the release or the server.
    ``transient``: the server was out of reach (connection, timeout) or answered 429 / 5xx, so the same request may
    succeed later."""

    transient = False


class HubPushUnverified(StepmergeError):
    """After a push, the Hub's own metadata of the revision (LFS sha256, git blob ids, the file set) does not match
    the release's manifest: the push is not done. ``path``: ``repo@revision``."""

    exit_code = 6


class AdapterError(StepmergeError):
    """A LoRA adapter is inconsistent with its base, its metadata, or the requested combination."""


class LoraRankMismatch(AdapterError):
    """A stored LoRA module's rank is not the rank PEFT gives it for the run's settings (a guess is never made).

    Built with `for_module`; the constructor keeps every named error's ``(message, path)`` contract, which
    is also what unpickling calls when the error crosses a process (Prefect, Ray)."""

    module: str = ""
    found: int = 0
    expected: int = 0

    @classmethod
    def for_module(cls, module: str, found: int, expected: int, settings: str,
                   path: str | None = None) -> "LoraRankMismatch":
        error = cls(f"{module}: the stored LoRA factors have rank {found} but PEFT gives this module rank "
                    f"{expected} for the run's settings ({settings})", path)
        error.module, error.found, error.expected = module, found, expected
        return error


class ValidationFailed(StepmergeError):
    """A merged model failed validation; nothing was published."""

    exit_code = 5


class StorageUnavailable(Exception):
    """The object store (or file server) stayed unreachable, slow or failing through every retry.

    Not a `StepmergeError` (nothing is wrong with the input, and retrying later may succeed), nor an
    ``OSError`` (code that reads ``OSError`` as "not a zip file" must not mistake an outage for a bad
    file). `merge_engine.storage.is_transient` calls it transient, so a pipeline task retries it; the
    CLI prints it as one line and exits 1, like any fault of the machine. ``path``: the URL; the
    original fault is its ``__cause__``.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        self.message = message
        self.path = path
        super().__init__(f"{message} [{path}]" if path else message)


class CredentialsMissing(StorageUnavailable):
    """No credentials for an object store were found (environment, config files, instance metadata):
    the message names what to set. Raised before any request, so nothing waits on retries or logs a
    traceback; permanent (`merge_engine.storage.is_transient` says False: a retry finds none either).
    ``store``: the canonical scheme (``s3``, ``gs``), so a layer above can add its own hint."""

    def __init__(self, message: str, path: str | None = None, store: str = "") -> None:
        super().__init__(message, path)
        self.store = store


class InvalidOption(StepmergeError):
    """A command-line option or parameter is invalid or contradicts the checkpoint."""


class BaseModelRequired(InvalidOption):
    """The step holds a LoRA adapter only (its base weights were not saved): a fused model needs the base
    the run trained from (``--base-model``, the flow's ``base_model``). Permanent: the same step without a
    base fails the same way, so a watcher must not submit it again."""


class InvalidDevice(InvalidOption):
    """A ``--device`` (a flow's ``device``) that names no torch device (``gpu9``), or one this machine's torch
    cannot use: ``cuda`` with a CPU-only build of torch or no CUDA device visible, ``cuda:3`` on a machine
    with fewer GPUs. Raised before anything is read or written (`merge_engine.devices.resolve_device`);
    ``path``: the device name as given."""


class RayClusterUnreachable(InvalidOption):
    """The ``--ray-address`` (``ray_address``) names no live Ray cluster: nothing answers there within a few
    seconds, or what answers is not Ray (`merge_engine.output.executors.ray_address`). ``path``: the address."""


class UnsupportedScheme(InvalidOption, ValueError):
    """A URL's scheme has no storage backend; the message lists the schemes served
    (`merge_engine.storage.schemes`). Also a ValueError: a URL that cannot be used."""


class UnguardedResultStorage(InvalidOption):
    """The result storage Prefect would cache the stage tasks' results in (``STEPMERGE_RESULT_STORAGE``, or
    ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK``) is a block of a type stepmerge cannot make read only its own
    JSON records: a record planted there could name a pickle. Raised when a flow run starts,
    before any task runs; ``path``: the block's slug."""


class TargetOverlapsSource(InvalidOption):
    """The target is an input, contains one, or lies inside one: writing there would destroy it."""


class RunRootNotFound(StepmergeError):
    """A run root holds no files: it does not exist (a typo?) or nothing was written there yet."""


class StepNotFound(StepmergeError):
    """The run root holds no checkpoint for the requested step and role (the message lists those it has)."""


class UnsupportedVersions(StepmergeError):
    """The installed transformers / peft are not a pair stepmerge is tested with (`merge_engine.versions`):
    the message names the installed versions and the tested ranges. Exit code 1, as for a fault of the machine:
    nothing is wrong with the input, and the same command runs once a tested pair is installed."""

    exit_code = 1
