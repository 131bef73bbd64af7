"""transformers' own save-time conversion, traced: each Hub tensor is a view of one stored tensor.

Specification: the traced reversal names what ``save_pretrained`` names (its per-expert tensors are
the slices of the fused one that transformers' ops cut), and a view's element runs are exactly the
elements ``torch.as_strided`` takes. A tensor transformers transposes on load only when its shape asks
(``Transpose(check_dims=True)``: Qwen3-VL-MoE's experts) is traced to the Hub's transposed layout when it
has the in-memory shape, left as it is when it already has the Hub's; a square one is written in transformers
5's layout, from the layout its writer's ``transformers_version`` says it was stored in (refused without one). A Hub tensor
computed from several stored ones is refused by default; asked for (``computed=True``) it is a
`ComputedTensor`, and `compute_reverse` makes it, bit for bit, as ``save_pretrained`` writes it (Kimi-K2.5's
vision ``wqkv``: q and k permuted back for rope, then q, k, v concatenated).
"""

from __future__ import annotations

import ast

import pytest
import torch

from merge_engine.errors import UnsupportedLayout
from merge_engine.plan.transformers_conversion import (
    ComputedTensor,
    TensorView,
    compute_reverse,
    _table_keys,
    conversion_known,
    conversion_table_keys,
    meta_model,
    square_hub_transposes,
    trace_reverse_conversion,
)
from synthetic_runs.models import ModelSpec, build_config


class TestTrace:
    def test_views_are_the_slices_save_pretrained_writes(self):
        """Each per-expert Hub tensor is the traced view of the fused tensor it came from."""
        model = meta_model(build_config(ModelSpec(family="qwen3_moe")).to_dict())
        fused = torch.arange(4 * 112 * 64, dtype=torch.float32).reshape(4, 112, 64)
        views = trace_reverse_conversion(model, {"model.layers.0.mlp.experts.gate_up_proj": (4, 112, 64)})
        assert len(views) == 8
        up = views["model.layers.0.mlp.experts.2.up_proj.weight"]
        assert up.is_contiguous() and list(up.runs()) == [(2 * 112 * 64 + 56 * 64, 56 * 64)]
        taken = torch.as_strided(fused.reshape(-1), up.shape, up.stride, up.offset)
        assert torch.equal(taken, fused[2, 56:])

    def test_a_hub_tensor_computed_from_several_is_refused(self):
        """A load-time split (Chunk) saves as a concatenation of two stored tensors: not a view of
        one, so it is refused (the user can keep the stored names), never computed wrongly."""
        from transformers.core_model_loading import Chunk, WeightConverter

        model = meta_model(build_config(ModelSpec(family="llama")).to_dict())
        split = WeightConverter(source_patterns="mlp.gate_up_proj.weight",
                                target_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                                operations=[Chunk(dim=0)])
        shapes = {"model.layers.0.mlp.gate_proj.weight": (112, 64), "model.layers.0.mlp.up_proj.weight": (112, 64)}
        with pytest.raises(UnsupportedLayout, match="several stored"):
            trace_reverse_conversion(model, shapes, [split])
        computed = trace_reverse_conversion(model, shapes, [split], computed=True)
        assert computed == {"model.layers.0.mlp.gate_up_proj.weight": ComputedTensor(
            tuple(shapes), (224, 64), "model.layers.0.mlp.gate_up_proj.weight", "mlp.gate_proj.weight")}
        gate, up = torch.randn(112, 64), torch.randn(112, 64)
        fused = compute_reverse(model, computed["model.layers.0.mlp.gate_up_proj.weight"],
                                dict(zip(shapes, (gate, up))), "model.layers.0.mlp.gate_up_proj.weight", [split])
        assert torch.equal(fused, torch.cat([gate, up]))

    def test_kimi_k25_vision_wqkv_is_computed_as_save_pretrained_writes_it(self, tmp_path):
        import transformers
        from safetensors.torch import load_file

        from synthetic_runs.tiny_configs import registry_families, tiny_config

        family = next(f for f in registry_families() if f.model_type == "kimi_k25")
        config = tiny_config(family)
        model = transformers.Kimi_K25ForConditionalGeneration._from_config(
            transformers.Kimi_K25ForConditionalGeneration.config_class(**config)).eval()
        model.save_pretrained(tmp_path)
        saved = {k: v for path in tmp_path.glob("*.safetensors") for k, v in load_file(path).items()}
        state = model.state_dict()
        views = trace_reverse_conversion(meta_model(config), {k: tuple(v.shape) for k, v in state.items()},
                                         computed=True)
        wqkv = {name: view for name, view in views.items() if isinstance(view, ComputedTensor)}
        assert wqkv and all(".wqkv." in name for name in wqkv)
        for name, view in wqkv.items():
            assert torch.equal(compute_reverse(meta_model(config), view, state, name), saved[name]), name
        assert set(saved) <= set(views)  # (save_pretrained drops a tied head)
        for name in saved:
            view = views[name]
            if isinstance(view, TensorView):
                taken = torch.as_strided(state[view.source].reshape(-1), view.shape, view.stride, view.offset)
                assert torch.equal(taken, saved[name]), name


class TestHubTranspose:
    EXPERTS = "model.language_model.layers.0.mlp.experts."

    def _model(self, version: str | None = "5.0.0", **text):
        from synthetic_runs.models import ModelSpec

        config = build_config(ModelSpec(family="qwen3_vl_moe")).to_dict()
        config["text_config"].update(text)
        config["transformers_version"] = version
        return meta_model(config)

    def test_in_memory_experts_are_traced_to_the_hub_layout(self):
        """(E, hidden, I) down_proj in memory -> (E, I, hidden) on the Hub: the transposed view of it."""
        views = trace_reverse_conversion(self._model(), {self.EXPERTS + "down_proj": (4, 64, 56),
                                                         self.EXPERTS + "gate_up_proj": (4, 112, 64)})
        down, gate_up = views[self.EXPERTS + "down_proj"], views[self.EXPERTS + "gate_up_proj"]
        stored = torch.arange(4 * 64 * 56).reshape(4, 64, 56)
        assert down.shape == (4, 56, 64) and not down.is_contiguous()
        assert torch.equal(torch.as_strided(stored.reshape(-1), down.shape, down.stride, down.offset),
                           stored.transpose(1, 2))
        assert gate_up.shape == (4, 64, 112)

    def test_experts_already_in_the_hub_layout_are_kept(self):
        views = trace_reverse_conversion(self._model(), {self.EXPERTS + "down_proj": (4, 56, 64)})
        assert views[self.EXPERTS + "down_proj"].is_whole((4, 56, 64))

    def test_square_experts_are_written_in_transformers_5_layout_by_the_writers_version(self):
        """hidden == moe_intermediate_size: 5.x does not transpose on load, so the folder holds its layout: a
        checkpoint of a 5.x trainer as stored, one of a 4.x trainer (the Hub's layout) transposed; listed."""
        name = self.EXPERTS + "down_proj"
        stored = torch.arange(4 * 64 * 64).reshape(4, 64, 64)
        for version, expected in (("5.3.0", stored), ("4.57.1", stored.transpose(1, 2))):
            model = self._model(version, hidden_size=64, moe_intermediate_size=64)
            view = trace_reverse_conversion(model, {name: (4, 64, 64)})[name]
            assert torch.equal(torch.as_strided(stored.reshape(-1), view.shape, view.stride, view.offset), expected)
            assert square_hub_transposes(model, {name: (4, 64, 64)}) == [name]
        assert square_hub_transposes(self._model(), {name: (4, 64, 56)}) == []

    def test_square_experts_of_an_unknown_writer_are_refused(self):
        """No transformers_version in config.json: the stored layout is unknown, never guessed."""
        model = self._model(None, hidden_size=64, moe_intermediate_size=64)
        with pytest.raises(UnsupportedLayout, match="names no transformers_version"):
            trace_reverse_conversion(model, {self.EXPERTS + "down_proj": (4, 64, 64)})


class TestTensorView:
    @pytest.mark.parametrize("shape,stride,offset", [((3, 4), (4, 1), 5), ((2, 3), (12, 1), 2),
                                                     ((2, 2, 2), (12, 4, 1), 1), ((3,), (2,), 0)])
    def test_view_runs_cover_the_view(self, shape, stride, offset):
        flat = torch.arange(40)
        view = TensorView("x", offset, shape, stride)
        runs = torch.cat([flat[a:a + n] for a, n in view.runs()])
        assert torch.equal(runs, torch.as_strided(flat, shape, stride, offset).reshape(-1))



class TestConversionTable:
    """`conversion_known` answers from the table's source (`conversion_table_keys`) without importing
    ``transformers.conversion_mapping`` (0.6-0.9 s); the fresh-process check is test_start_imports.py."""

    def test_the_keys_read_from_the_source_hold_every_key_of_the_real_table(self):
        from transformers.conversion_mapping import _build_checkpoint_conversion_mapping

        real = {key for key, value in _build_checkpoint_conversion_mapping().items() if value}
        listed = conversion_table_keys()
        assert listed is not None and real <= listed
        assert {"qwen3_moe", "mixtral", "Qwen2VLForConditionalGeneration"} <= listed
        assert not {"qwen2", "llama", "Qwen2ForCausalLM"} & listed

    @pytest.mark.parametrize("family, converted", [("qwen2", False), ("llama", False), ("qwen3_moe", True),
                                                   ("mixtral", True), ("qwen2_vl", True)])
    def test_conversion_known(self, family, converted):
        assert conversion_known(build_config(ModelSpec(family=family)).to_dict()) is converted

    @pytest.mark.parametrize("body", [
        "mapping = {'a': []}\n    mapping[name()] = []\n    return mapping",          # a computed key
        "mapping = {'a': []}\n    mapping.update(other)\n    return mapping",         # mutated by a method
        "mapping = {'a': []}\n    register(mapping)\n    return mapping",             # passed on
        "mapping = {'a': []}\n    mapping = dict(mapping, b=[])\n    return mapping", # rebound
        "mapping = {**base}\n    return mapping",                                     # unpacked
        "mapping = build()\n    return mapping",                                      # not a literal
    ])
    def test_a_source_it_does_not_follow_is_not_guessed(self, body):
        source = f"_MODEL_TO_CONVERSION_PATTERN = {{'x': 'a'}}\ndef _build_checkpoint_conversion_mapping():\n    {body}\n"
        assert _table_keys(ast.parse(source)) is None

    def test_a_source_it_follows(self):
        source = ("_MODEL_TO_CONVERSION_PATTERN = {'x': 'a'}\n"
                  "def _build_checkpoint_conversion_mapping():\n"
                  "    mapping = {'a': [1]}\n    mapping['b'] = mapping['a'].copy()\n    mapping['c'] += [2]\n"
                  "    for model_type, base in _MODEL_TO_CONVERSION_PATTERN.items():\n"
                  "        if model_type in mapping:\n            continue\n"
                  "        mapping[model_type] = mapping[base].copy()\n    return mapping\n")
        assert _table_keys(ast.parse(source)) == {"a", "b", "c", "x"}
