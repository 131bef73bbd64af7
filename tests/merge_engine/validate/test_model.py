"""`validate_model` (`merge_engine.validate.model`): every check in one report, round-tripped and raisable."""

from __future__ import annotations

import json

import pytest
import torch

from merge_engine import storage
from merge_engine.errors import ValidationFailed
from merge_engine.validate import ValidationReport, validate_model
from tests.merge_engine.validate.hf_folders import failed, write_hf_folder


class TestValidateModel:
    def test_everything_passes_and_round_trips(self, root_url, qwen):
        model = write_hf_folder(storage.join(root_url, "m"), *qwen)
        ref = write_hf_folder(storage.join(root_url, "r"), *qwen, shards=1)
        report = validate_model(model, ref)
        assert report.ok, report.summary()
        assert report.model_url == model and report.reference_url == ref
        names = [c.name for c in report.checks]
        assert {"finite", "reference_values", "load", "forward", "reference_logits"} <= set(names)
        assert report.summary().startswith(f"**Validation PASSED** ({len(names)}/{len(names)} checks)")
        assert ValidationReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
        report.raise_for_failure()

    def test_failure_is_reported_and_raisable(self, tmp_path, qwen):
        config, tensors = qwen
        bad = dict(tensors, **{"model.norm.weight": torch.full_like(tensors["model.norm.weight"], float("inf"))})
        report = validate_model(write_hf_folder(str(tmp_path / "m"), config, bad), forward=False)
        assert not report.ok and set(failed(report)) == {"finite"}
        assert "**FAIL** `finite`" in report.summary()
        with pytest.raises(ValidationFailed, match="finite") as err:
            report.raise_for_failure()
        assert err.value.path == str(tmp_path / "m")

    def test_empty_report_is_not_ok(self):
        assert not ValidationReport("x").ok

