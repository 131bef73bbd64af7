"""Session fixtures: the fixture matrices merged once with the default options (``--weights-format hub``),
shared by the tests that read the merged folders (transformers 5 here, transformers 4.57 in
`tests.merge_engine.plan.test_hub_readers`).

`merged_families`: every run of `family_runs` (`synthetic_runs.fsdp.family_matrix()`) -> its folder.
`merged_megatron`: every checkpoint of `megatron_runs` merged with ``--backend megatron`` -> its folder
(DeepSeek's MTP layer dropped: the reference model has none; Megatron-LM runs take the reference config).
"""

from __future__ import annotations

import pytest

from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions


def megatron_checkpoint_url(job) -> str:
    """Where a user points stepmerge: verl's ``global_step_N/actor``, Megatron-LM's ``iter_N``."""
    return str(job.step_dir / "actor") if job.spec.fmt not in ("megatron_lm", "megatron_lm_dist") else str(job.step_dir)


def megatron_hf_model_path(job) -> str | None:
    """Megatron-LM saves no Hugging Face config: the user passes one (here the reference's)."""
    from synthetic_runs.megatron import REFERENCE_HF_DIR

    return str(job.reference_dir / REFERENCE_HF_DIR) if job.spec.fmt.startswith("megatron_lm") else None


@pytest.fixture(scope="session")
def merged_families(family_runs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hub_merged")
    out = {}
    for name, run in family_runs.items():
        out[name] = str(root / name)
        merge_checkpoint(run.latest.checkpoint_dir, out[name])
    return out


@pytest.fixture(scope="session")
def merged_megatron(megatron_runs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("megatron_merged")
    out = {}
    for name, job in sorted(megatron_runs.items()):
        out[name] = str(root / name)
        mtp = "drop" if job.spec.mtp_layers else None
        merge_checkpoint(megatron_checkpoint_url(job), out[name],
                         OutputOptions(backend="megatron", hf_model_path=megatron_hf_model_path(job), mtp_layers=mtp))
    return out
