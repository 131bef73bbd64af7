"""Discovery: a run root's listing -> steps, roles, layouts and completeness, without reading weights.

The trees are written through `merge_engine.storage`, so each test runs on any backend the
`root_url` fixture offers (`tests.fixtures_storage`: a local folder, ``memory://``, a SeaweedFS S3
bucket, a fake-GCS bucket).
File contents are placeholders: discovery must decide from names and sizes alone.
"""

from __future__ import annotations


import pytest

from merge_engine import storage

from merge_engine.layouts import discovery
from merge_engine.errors import RunRootNotFound
from merge_engine.layouts.discovery import (
    COMPLETE,
    INCOMPLETE,
    INVALID,
    discover,
    discover_step,
    discover_steps,
)
from merge_engine.layouts.fsdp import listing_verdict as fsdp_listing_verdict
from merge_engine.storage import FileEntry
from tests.merge_engine.layouts.latest_step import latest_complete_step

def write_tree(root: str, files: dict[str, bytes | int]) -> None:
    """Write `files` (relative path -> bytes, or a size in bytes of placeholder content) under root."""
    for rel, content in files.items():
        data = content if isinstance(content, bytes) else b"x" * content
        storage.write_bytes(storage.join(root, *rel.split("/")), data)


def fsdp_files(prefix: str, world: int = 2, *, skip_ranks=(), empty_ranks=(), config=True,
               kinds=("model", "optim", "extra_state"), hf_config=True) -> dict[str, int]:
    """What verl's FSDP checkpoint manager writes into one role folder."""
    files: dict[str, int] = {}
    for kind in kinds:
        for rank in range(world):
            if rank in skip_ranks:
                continue
            size = 0 if rank in empty_ranks and kind == "model" else 10
            files[f"{prefix}{kind}_world_size_{world}_rank_{rank}.pt"] = size
    if config:
        files[f"{prefix}fsdp_config.json"] = 40
    if hf_config:
        files[f"{prefix}huggingface/config.json"] = 30
    return files


def entries(paths: dict[str, int]) -> list[FileEntry]:
    return [FileEntry(p, s, "v") for p, s in paths.items()]


def by_key(steps) -> dict[tuple[int, str], discovery.Step]:
    return {(s.step, s.role): s for s in steps}


class TestRunRoot:
    def test_rl_run_with_actor_and_critic_roles(self, root_url):
        """verl RL writes global_step_N/{actor,critic}/ + data.pt; each role is its own checkpoint."""
        tree = {"latest_checkpointed_iteration.txt": b"20", "global_step_10/data.pt": 5, "global_step_20/data.pt": 5}
        for step in (10, 20):
            tree |= fsdp_files(f"global_step_{step}/actor/")
            tree |= fsdp_files(f"global_step_{step}/critic/")
        write_tree(root_url, tree)

        found = discover(root_url)
        assert found.tracker_hint == 20
        assert [(s.step, s.role, s.status, s.layout) for s in found.steps] == [
            (10, "actor", COMPLETE, "fsdp"),
            (10, "critic", COMPLETE, "fsdp"),
            (20, "actor", COMPLETE, "fsdp"),
            (20, "critic", COMPLETE, "fsdp"),
        ]
        actor = found.steps[2]
        assert actor.url == storage.join(root_url, "global_step_20", "actor")
        assert actor.key == f"{root_url}:actor:20"
        # The step's own listing travels with it, relative to its folder; data.pt belongs to no role.
        assert {f.path for f in actor.files} >= {"model_world_size_2_rank_0.pt", "fsdp_config.json"}
        assert all(not f.path.startswith("actor/") for f in actor.files)

    def test_sft_writes_straight_into_the_step_folder(self, root_url):
        """SFT trainers have no actor/ folder: role "" and the weights folder is the step folder."""
        write_tree(root_url, fsdp_files("global_step_3/", world=1) | {"latest_checkpointed_iteration.txt": b"3\n"})
        (step,) = discover_steps(root_url)
        assert (step.step, step.role, step.status) == (3, "", COMPLETE)
        assert step.url == storage.join(root_url, "global_step_3")

    def test_pruned_step_holding_only_data_pt_is_not_a_checkpoint(self, root_url):
        """Retention deletes actor/ and keeps data.pt: such a step must not be reported at all."""
        write_tree(root_url, {"global_step_1/data.pt": 5} | fsdp_files("global_step_2/actor/"))
        assert [s.step for s in discover_steps(root_url)] == [2]

    def test_tracker_is_only_a_hint(self, root_url):
        """Stale, torn or missing tracker files change nothing about which steps exist."""
        tree = fsdp_files("global_step_5/actor/") | fsdp_files("global_step_7/actor/")
        write_tree(root_url, tree | {"latest_checkpointed_iteration.txt": b"5"})  # stale: 7 exists
        found = discover(root_url)
        assert found.tracker_hint == 5
        assert latest_complete_step(found).step == 7

        write_tree(root_url, {"latest_checkpointed_iteration.txt": b""})  # torn in-place write
        assert discover(root_url).tracker_hint is None
        storage.remove(storage.join(root_url, "latest_checkpointed_iteration.txt"))  # async save: none
        found = discover(root_url)
        assert found.tracker_hint is None and [s.step for s in found.steps] == [5, 7]

    def test_tracker_pointing_at_a_step_that_is_not_there(self, root_url):
        write_tree(root_url, fsdp_files("global_step_5/actor/") | {"latest_checkpointed_iteration.txt": b"9"})
        found = discover(root_url)
        assert found.tracker_hint == 9 and [s.step for s in found.steps] == [5]

    def test_missing_or_empty_run_root_is_an_error_naming_it(self, root_url):
        """A typo in the run root must not look like "no checkpoints yet" (issue 11, point 1)."""
        missing = storage.join(root_url, "nothing-here")
        for call in (discover, discover_steps, latest_complete_step):
            with pytest.raises(RunRootNotFound) as caught:
                call(missing)
            assert caught.value.path == missing and "typo" in caught.value.message

    def test_unrelated_folders_are_ignored(self, root_url):
        write_tree(root_url, fsdp_files("global_step_x/actor/") | fsdp_files("tensorboard/actor/")
                   | fsdp_files("global_step_4/actor/"))
        assert [s.step for s in discover_steps(root_url)] == [4]

    def test_one_listing_and_no_weight_reads(self, root_url, monkeypatch):
        """Discovery lists the run root once and reads nothing but the tracker file."""
        tree = {"latest_checkpointed_iteration.txt": b"2"}
        for step in range(1, 4):
            tree |= fsdp_files(f"global_step_{step}/actor/") | fsdp_files(f"global_step_{step}/critic/")
        write_tree(root_url, tree)
        listed, read = [], []
        real_list, real_read = storage.list_files, storage.read_bytes
        monkeypatch.setattr(storage, "list_files", lambda url, **kw: listed.append(url) or real_list(url, **kw))
        monkeypatch.setattr(storage, "read_bytes", lambda url: read.append(url) or real_read(url))
        monkeypatch.setattr(storage, "list_dirs", lambda url: pytest.fail("list_dirs is a round trip per step"))

        found = discover(root_url)
        assert len(found.steps) == 6
        assert listed == [root_url]
        assert read == [storage.join(root_url, "latest_checkpointed_iteration.txt")]

    def test_fingerprint_changes_with_the_listing(self, root_url):
        write_tree(root_url, fsdp_files("global_step_1/actor/"))
        before = discover_steps(root_url)[0].fingerprint
        assert discover_steps(root_url)[0].fingerprint == before  # stable
        write_tree(root_url, {"global_step_1/actor/model_world_size_2_rank_1.pt": 11})  # rewritten
        assert discover_steps(root_url)[0].fingerprint != before


class TestIncompleteSteps:
    def test_fsdp_missing_rank_is_incomplete_not_an_error(self, root_url):
        """fsdp_config.json comes from rank 0 before the last barrier: it does not prove the others."""
        write_tree(root_url, fsdp_files("global_step_1/actor/", world=4, skip_ranks=(3,)))
        (step,) = discover_steps(root_url)
        assert step.status == INCOMPLETE and "[3]" in step.reason

    def test_fsdp_empty_rank_file_is_incomplete(self, root_url):
        write_tree(root_url, fsdp_files("global_step_1/actor/", world=2, empty_ranks=(1,)))
        (step,) = discover_steps(root_url)
        assert step.status == INCOMPLETE and "empty" in step.reason

    def test_fsdp_without_config_is_incomplete(self, root_url):
        write_tree(root_url, fsdp_files("global_step_1/actor/", config=False))
        (step,) = discover_steps(root_url)
        assert step.status == INCOMPLETE and "fsdp_config.json" in step.reason

    def test_later_step_completes_while_an_earlier_one_is_still_written(self, root_url):
        """A late lower step: 10 incomplete, 20 complete; then 10 completes and becomes latest-but-one."""
        write_tree(root_url, fsdp_files("global_step_10/actor/", skip_ranks=(1,)) | fsdp_files("global_step_20/actor/"))
        steps = by_key(discover_steps(root_url))
        assert steps[(10, "actor")].status == INCOMPLETE and steps[(20, "actor")].complete
        write_tree(root_url, fsdp_files("global_step_10/actor/"))
        assert by_key(discover_steps(root_url))[(10, "actor")].complete

    def test_mixed_world_sizes_are_invalid(self, root_url):
        write_tree(root_url, fsdp_files("global_step_1/actor/", world=2) | fsdp_files("global_step_1/actor/", world=4))
        (step,) = discover_steps(root_url)
        assert step.status == INVALID and "[2, 4]" in step.reason

    def test_latest_complete_step_skips_incomplete_and_other_roles(self, root_url):
        write_tree(root_url, fsdp_files("global_step_1/actor/") | fsdp_files("global_step_2/actor/")
                   | fsdp_files("global_step_3/actor/", skip_ranks=(0,)) | fsdp_files("global_step_4/critic/"))
        assert latest_complete_step(root_url).step == 2
        assert latest_complete_step(root_url, role="critic").step == 4
        assert latest_complete_step(root_url, role="") is None


class TestFsdpListingRule:
    """The watcher's listing-level FSDP rule."""

    def test_complete(self):
        verdict = fsdp_listing_verdict(entries(fsdp_files("", world=3)))
        assert verdict.complete

    def test_model_only_checkpoint_is_complete(self):
        """save_contents=['model']: no optim/extra files at all is fine."""
        assert fsdp_listing_verdict(entries(fsdp_files("", world=2, kinds=("model",)))).complete

    def test_a_rank_still_writing_its_later_files(self):
        """Rank 1 has written model but not yet extra_state (it writes model, optim, extra in order)."""
        files = fsdp_files("", world=2)
        del files["extra_state_world_size_2_rank_1.pt"]
        verdict = fsdp_listing_verdict(entries(files))
        assert verdict.status == INCOMPLETE and "extra_state" in verdict.reason

    def test_config_world_size_must_agree_with_names(self):
        verdict = fsdp_listing_verdict(entries(fsdp_files("", world=2)), config_world_size=4)
        assert verdict.status == INVALID and "4" in verdict.reason
        assert fsdp_listing_verdict(entries(fsdp_files("", world=2)), config_world_size=2).complete

    def test_rank_beyond_world_size(self):
        files = fsdp_files("", world=2) | {"model_world_size_2_rank_2.pt": 10}
        assert fsdp_listing_verdict(entries(files)).status == INVALID

    def test_no_model_files_yet(self):
        assert fsdp_listing_verdict(entries({"fsdp_config.json": 10})).status == INCOMPLETE


class TestOtherLayouts:
    def test_megatron_v2_marker_decides(self, root_url):
        """verl v2 Megatron: ckpt_contents.json is written last; without it the step is not done."""
        body = {"model/dist_ckpt/__0_0.distcp": 10, "model/dist_ckpt/.metadata": 5,
                "model/dist_ckpt/metadata.json": 5, "optimizer/dist_ckpt/__0_0.distcp": 10,
                "model/huggingface/config.json": 5, "transformer_config.json": 5}
        write_tree(root_url, {f"global_step_1/actor/{k}": v for k, v in body.items()}
                   | {f"global_step_2/actor/{k}": v for k, v in body.items()}
                   | {"global_step_2/actor/ckpt_contents.json": 20})
        steps = by_key(discover_steps(root_url))
        assert steps[(1, "actor")].layout == "megatron_dist" and steps[(1, "actor")].status == INCOMPLETE
        assert steps[(2, "actor")].complete

    def test_megatron_v2_bridge_weights_only_in_huggingface(self, root_url):
        """With a bridge the actor's weights live only in model/huggingface/ as safetensors."""
        body = {"model/huggingface/model.safetensors": 10, "model/huggingface/config.json": 5,
                "optimizer/dist_ckpt/__0_0.distcp": 10, "optimizer/dist_ckpt/.metadata": 5}
        write_tree(root_url, {f"global_step_1/actor/{k}": v for k, v in body.items()})
        (step,) = discover_steps(root_url)
        assert (step.layout, step.status) == ("megatron_bridge", INCOMPLETE)  # no ckpt_contents.json yet
        write_tree(root_url, {"global_step_1/actor/ckpt_contents.json": 20})
        assert discover_steps(root_url)[0].complete

    def test_megatron_v1_dist_ckpt(self, root_url):
        body = {"dist_ckpt/__0_0.distcp": 10, "dist_ckpt/common.pt": 10, "huggingface/config.json": 5,
                "transformer_config.json": 5}
        write_tree(root_url, {f"global_step_1/actor/{k}": v for k, v in body.items()}
                   | {f"global_step_2/actor/{k}": v for k, v in body.items()}
                   | {"global_step_2/actor/dist_ckpt/.metadata": 5, "global_step_2/actor/dist_ckpt/metadata.json": 5})
        steps = by_key(discover_steps(root_url))
        assert steps[(1, "actor")].status == INCOMPLETE and ".metadata" in steps[(1, "actor")].reason
        assert steps[(2, "actor")].layout == "megatron_dist" and steps[(2, "actor")].complete

    def test_megatron_legacy_rank_grid(self, root_url):
        """model/mp_rank_TT_PPP/model.pt: a hole in the TP x PP grid is a step still being written."""
        full = {f"model/mp_rank_{tp:02d}_{pp:03d}/model.pt": 10 for tp in range(2) for pp in range(2)}
        holed = dict(full)
        del holed["model/mp_rank_01_000/model.pt"]
        write_tree(root_url, {f"global_step_1/actor/{k}": v for k, v in full.items()}
                   | {f"global_step_2/actor/{k}": v for k, v in holed.items()})
        steps = by_key(discover_steps(root_url))
        assert steps[(1, "actor")].layout == "megatron_legacy" and steps[(1, "actor")].complete
        assert steps[(2, "actor")].status == INCOMPLETE

    def test_megatron_lm_iteration_folders(self, root_url):
        """Megatron-LM's own run root: iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt, role ""."""
        write_tree(root_url, {"iter_0000100/mp_rank_00/model_optim_rng.pt": 10,
                              "iter_0000100/mp_rank_01/model_optim_rng.pt": 10,
                              "latest_checkpointed_iteration.txt": b"100"})
        (step,) = discover_steps(root_url)
        assert (step.step, step.role, step.layout, step.status) == (100, "", "megatron_legacy", COMPLETE)

    def test_one_step_is_classified_from_its_own_folder_alone(self, root_url, monkeypatch):
        """`discover_step` lists the step folder (never the run root) and says what `discover` says."""
        write_tree(root_url, fsdp_files("global_step_10/actor/") | fsdp_files("global_step_10/critic/")
                   | fsdp_files("global_step_20/actor/", skip_ranks=(1,)) | fsdp_files("global_step_30/", world=1)
                   | {"iter_0000100/mp_rank_00/model_optim_rng.pt": 10, "global_step_40/data.pt": 5})
        whole = by_key(discover_steps(root_url))
        listed: list[str] = []
        real_list = storage.list_files
        monkeypatch.setattr(storage, "list_files", lambda url, *a, **k: listed.append(url) or real_list(url, *a, **k))

        for step, role in ((10, "actor"), (10, "critic"), (20, "actor"), (30, ""), (100, "")):
            found = discover_step(root_url, step, role)
            assert found == whole[(step, role)] and found.files == whole[(step, role)].files
            assert found.fingerprint == whole[(step, role)].fingerprint
        assert discover_step(root_url, 10, "") is None  # the step has roles, no SFT weights
        assert discover_step(root_url, 40, "actor") is None  # pruned: only data.pt is left
        assert discover_step(root_url, 50, "actor") is None  # not written yet
        assert root_url not in listed and all(url.startswith(storage.join(root_url, "")) for url in listed)
        assert discover_step(root_url, 20, "actor").status == INCOMPLETE

    def test_fsdp_with_hf_weights_lists_both_layouts_fsdp_first(self, root_url):
        write_tree(root_url, fsdp_files("global_step_1/actor/")
                   | {"global_step_1/actor/huggingface/model.safetensors": 10})
        (step,) = discover_steps(root_url)
        assert step.layouts == ("fsdp", "hf") and step.layout == "fsdp"

    def test_hf_shards_without_index_are_incomplete(self, root_url):
        write_tree(root_url, {"global_step_1/actor/huggingface/model-00001-of-00002.safetensors": 10})
        (step,) = discover_steps(root_url)
        assert (step.layout, step.status) == ("hf", INCOMPLETE)
        write_tree(root_url, {"global_step_1/actor/huggingface/model-00002-of-00002.safetensors": 10,
                              "global_step_1/actor/huggingface/model.safetensors.index.json": 10})
        assert discover_steps(root_url)[0].complete
