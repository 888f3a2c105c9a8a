"""QLoRA-MCL in the recipes: SmolLM2-135M in nf4 trains the bilingual task's quick run (`quantization: nf4` in the
recipe's common.yaml, as `loramcl train --config bilingual/common.yaml --config bilingual/mcl-relaxed.yaml
--quantization nf4` reads it), then decodes its K hypotheses on the same quantized base; a processor task's run
(audio, image) trains on the quantized base its recipe names and records it."""

import json
import math
import shutil
import warnings

import pytest

from loramcl.recipes.bilingual.reproduce import bilingual
from loramcl.recipes.files import packaged_recipes

pytest.importorskip("bitsandbytes")


@pytest.mark.slow  # 77 s alone, 145 s in the clean-clone suite on 2 cores: run by hand, `pytest -m slow` (issue 39)
def test_smollm2_in_nf4_trains_the_bilingual_quick_run(tmp_path, monkeypatch, smollm2_folder):
    from transformers import AutoTokenizer

    from loramcl.decoding import generate_hypotheses
    from loramcl.mcl.quantization import BNB_4BIT, quantization_backend
    from loramcl.models import load_model
    from loramcl.utils.inputs import BaseWeightsMismatch

    recipe = tmp_path / "recipe"
    shutil.copytree(packaged_recipes() / "bilingual", recipe)
    with (recipe / "common.yaml").open("a") as common:
        common.write("quantization: nf4\n")
    out = tmp_path / "runs" / "bilingual"
    out.mkdir(parents=True)
    (out / "SmolLM2-135M-Instruct").symlink_to(smollm2_folder)
    monkeypatch.chdir(tmp_path)
    bilingual(out=str(out), recipes=str(recipe), quick=True, stop_after="train", runs=["mcl-relaxed"], threads=1)
    run = out / "mcl-relaxed"
    record = json.loads((run / "run.json").read_text())
    assert record["settings"]["quantization"] == "nf4" and record["settings"]["mcl"]["num_hypotheses"] == 2
    losses = [entry["loss"] for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseWeightsMismatch)  # the nf4 base its run.json names, as in training
        mcl = load_model(str(smollm2_folder), str(run))
    assert quantization_backend(mcl.base_model.model.layers[0].self_attn.q_proj.base_layer) == BNB_4BIT
    prompt = json.loads((out / "data" / "test.jsonl").open().readline())["prompt"]
    candidates = generate_hypotheses(mcl, AutoTokenizer.from_pretrained(smollm2_folder), [prompt], max_new_tokens=6)
    assert [candidate.hypothesis for candidate in candidates[0]] == [0, 1]
    assert all(candidate.token_ids for candidate in candidates[0])


def test_a_processor_task_run_trains_on_the_quantized_base_its_recipe_names(tmp_path, monkeypatch):
    """The audio and image tasks train through ``recipes.steps.fit_run``: the base loads quantized and the run's
    settings record it (their decoding then loads it back from the run's run.json, as `loramcl generate`)."""
    import transformers as tf

    import loramcl.training.fit as fitting
    from loramcl.mcl.quantization import BNB_8BIT, quantization_backend
    from loramcl.recipes import steps
    from loramcl.training.config import TrainConfig

    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4)).save_pretrained(tmp_path / "base")
    values = {"model": str(tmp_path / "base"), "out": str(tmp_path / "run"), "mcl": {"num_hypotheses": 2},
              "quantization": "int8"}
    settings = steps.run_file_settings(values, TrainConfig(), tmp_path, {})
    assert settings["quantization"] == "int8"
    assert "quantization" not in steps.run_file_settings({**values, "quantization": None}, TrainConfig(), tmp_path, {})
    loaded = []
    monkeypatch.setattr(fitting, "fit", lambda load, *args, **kwargs: loaded.append(load()))
    steps.fit_run(values, TrainConfig(), settings, lambda: (None, None, None, None))
    assert quantization_backend(loaded[0].model.layers[0].self_attn.q_proj) == BNB_8BIT
