"""One module per storage system; each defines ``BACKEND``, a `merge_engine.storage.backend.Backend`.

The registry (`merge_engine.storage.schemes`) imports every module in this folder, so adding a
store (Azure's ``abfs://``, say) is adding one file here: a `FsspecBackend` subclass naming its
schemes, its client and its client's transient faults. Modules here import no storage client at
import time (the webhook reads the registry): clients are imported when first used.
"""
