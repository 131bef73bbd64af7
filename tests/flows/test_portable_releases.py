"""Releases travel: copied to another folder, the original deleted, they load with transformers and PEFT as their
model card says, from a process whose working folder is outside the build's tree; no text file of them names a
path of the machine that built them; each has a model card huggingface_hub parses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import torch
from huggingface_hub import ModelCard

from flows.merge_step import merge_step
from flows.params import MergeStepParams
from merge_engine.release.manifest import read_manifest
from tests.fixtures_pipeline import LORA_STEP, copy_steps
from tests.release_checks import REPO, TOKENS, assert_no_machine_paths

# the card's own load lines, run in the copied release's folder; the logits written where the test reads them
LOAD = """
import sys, torch
{card}
with torch.no_grad():
    logits = model.eval()(input_ids=torch.tensor({tokens})).logits
torch.save(logits, sys.argv[1])
"""


def _card_code(release: str) -> str:
    card = ModelCard.load(os.path.join(release, "README.md"))
    (code,) = re.findall(r"```python\n(.*?)```", card.text, re.DOTALL)
    return code


def _load_in(folder: str, code: str, out: str) -> torch.Tensor:
    """Run ``code`` (which sets ``model``) in a fresh Python whose working folder is ``folder``; its logits."""
    script = LOAD.format(card=textwrap.dedent(code), tokens=TOKENS.tolist())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the build's tree on the path
    done = subprocess.run([sys.executable, "-c", script, out], cwd=folder, env={**env, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_a_lora_steps_releases_load_from_a_copy_elsewhere_as_their_cards_say(prefect, template_run, tmp_path):
    build = tmp_path / "build"
    run_root, staging = str(build / "run"), str(build / "staging")
    copy_steps(template_run, run_root, [LORA_STEP])
    outcome = merge_step(**MergeStepParams(run_root=run_root, step=LORA_STEP, staging_root=staging).flow_parameters())
    releases = {r.kind: r.url for r in outcome.releases}
    assert set(releases) == {"model", "adapter"}

    for kind, url in releases.items():
        assert_no_machine_paths(url, roots=(str(build), run_root))
        card = ModelCard.load(os.path.join(url, "README.md"))
        assert card.data.library_name == {"model": "transformers", "adapter": "peft"}[kind]
        assert card.data.pipeline_tag == "text-generation"
        assert card.data.tags[:3] == ["stepmerge", "verl", f"step-{LORA_STEP}"]
        manifest = read_manifest(url)
        assert manifest.source == f"global_step_{LORA_STEP}/actor" and "README.md" in {f.path for f in manifest.files}
        assert manifest.validation["model_url"] == "."

    elsewhere = tmp_path / "elsewhere"
    copies = {kind: shutil.copytree(url, elsewhere / kind) for kind, url in releases.items()}
    shutil.rmtree(build)  # the original is gone: nothing may resolve to it
    assert not str(elsewhere).startswith(REPO)
    trained = template_run.trained_model(LORA_STEP)
    with torch.no_grad():
        expected = trained(input_ids=TOKENS).logits
    for kind, copy in copies.items():
        got = _load_in(str(copy), _card_code(str(copy)), str(tmp_path / f"{kind}.pt"))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
