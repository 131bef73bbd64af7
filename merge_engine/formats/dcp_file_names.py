"""The file names ``torch.distributed.checkpoint`` writes in a checkpoint folder, for listings.

No torch import: a layout's listing verdict (`merge_engine.layouts.megatron_dist`) reads them without
the reader (`merge_engine.formats.torch_dcp`), which imports these from here.
"""

METADATA_FILE = ".metadata"  # written by the coordinator after every rank's data: the save finished
DATA_SUFFIX = ".distcp"  # each rank's data files: ``__<rank>_<n>.distcp``
DATA_FILE = "__0_0" + DATA_SUFFIX  # the one data file stepmerge's writer makes
