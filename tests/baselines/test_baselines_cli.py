"""`loramcl train --method moe|multihead` and `loramcl generate` on their folders: the baselines go through the same
commands as LoRA-MCL; bad combinations say what to change."""

import json

import pytest
from tiny_models import save_tiny_run_inputs
from transformers import AutoModelForCausalLM

from loramcl import DataConfig, MCLConfig, TrainConfig, load_mcl_model
from loramcl.baselines import MoEConfig, MultiHeadConfig
from loramcl.baselines.moe import MoEModel
from loramcl.baselines.multihead import MultiHeadModel
from loramcl.cli import main
from loramcl.decoding.predictions import generate
from loramcl.recipes.files import packaged_recipes
from loramcl.training.fit import COMMAND_MCL, train
from loramcl.training.reference_nll import nll


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("baselines")
    save_tiny_run_inputs(root)
    prompts = [{"id": "a", "prompt": "w5 w20", "references": ["w40 w60"]}, {"id": "b", "prompt": "w6 w21",
                                                                            "references": ["w41"]}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    return root


def _train(folders, out, **method):
    return train(model=str(folders / "base"), out=str(out), data=DataConfig(train_file=str(folders / "train.jsonl")),
                 training=TrainConfig(steps=2, batch_size=8, learning_rate=1e-2), threads=1, **method)


def test_moe_run_trains_decodes_both_ways_and_scores(folders):
    out = folders / "moe"
    main(["train", "--model", str(folders / "base"), "--out", str(out), "--method", "moe", "--moe.num_experts", "3",
          "--moe.r", "2", "--moe.target_modules", "[q_proj, v_proj]", "--moe.router_init", "normal",
          "--data.train_file", str(folders / "train.jsonl"), "--training.steps", "2", "--training.batch_size", "8",
          "--threads", "1"])
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["method"] == "moe" and run["settings"]["moe"]["num_experts"] == 3
    assert isinstance(load_mcl_model(AutoModelForCausalLM.from_pretrained(folders / "base"), out), MoEModel)
    for strategy in ("stochastic_router", "beam"):
        preds = folders / f"moe-{strategy}.jsonl"
        generate(model=str(folders / "base"), adapters=str(out), input=str(folders / "prompts.jsonl"), out=str(preds),
                 strategy=strategy, num_sequences=2, budget=2, max_new_tokens=3)
        assert all(len(json.loads(line)["candidates"]) == 2 for line in preds.read_text().splitlines())
    scores = folders / "moe-nll.jsonl"
    nll(model=str(folders / "base"), adapters=str(out), input=str(folders / "prompts.jsonl"), out=str(scores))
    assert [len(r["nll"][0]) for r in map(json.loads, scores.read_text().splitlines())] == [1, 1]  # one model


def test_multihead_run_trains_and_decodes_one_candidate_per_head(folders):
    out = folders / "multihead"
    _train(folders, out, method="multihead",
           multihead=MultiHeadConfig(num_hypotheses=2, module="lm_head", loss="relaxed", epsilon=0.1))
    assert isinstance(load_mcl_model(AutoModelForCausalLM.from_pretrained(folders / "base"), out), MultiHeadModel)
    preds = folders / "multihead.jsonl"
    generate(model=str(folders / "base"), adapters=str(out), input=str(folders / "prompts.jsonl"), out=str(preds),
             max_new_tokens=3)
    assert all(json.loads(line)["hypotheses"] == [0, 1] for line in preds.read_text().splitlines())


def test_bad_method_combinations_say_what_to_change(folders, tmp_path):
    with pytest.raises(ValueError, match="method 'moe' needs its configuration: --moe"):
        _train(folders, tmp_path / "a", method="moe")
    with pytest.raises(ValueError, match="--mcl.\\* configures method 'mcl' but method is 'moe'"):
        _train(folders, tmp_path / "b", method="moe", moe=MoEConfig(), mcl=MCLConfig(num_hypotheses=3))
    with pytest.raises(ValueError, match="--moe.\\* configures method 'moe' but method is 'mcl'"):
        _train(folders, tmp_path / "c", moe=MoEConfig())
    with pytest.raises(ValueError, match="method must be one of"):
        _train(folders, tmp_path / "d", method="lora-moe", moe=MoEConfig())
    with pytest.raises(ValueError, match="has no module 'head'"):
        _train(folders, tmp_path / "e", method="multihead", multihead=MultiHeadConfig(module="head"))
    with pytest.raises(ValueError, match="LoRA-MoE"):
        generate(model=str(folders / "base"), adapters=str(folders / "multihead"), input=str(folders / "prompts.jsonl"),
                 out=str(tmp_path / "p.jsonl"), strategy="stochastic_router", num_sequences=2)


def test_baseline_recipes_select_their_method():
    from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(train)
    recipes = packaged_recipes() / "bilingual"
    for method, config_class in (("moe", MoEConfig), ("multihead", MultiHeadConfig)):
        values = parser.instantiate_classes(parser.parse_args(
            ["--config", str(recipes / "common.yaml"), "--config", str(recipes / f"{method}.yaml")]))
        assert values.method == method and isinstance(values[method], config_class) and values.mcl == COMMAND_MCL
    with pytest.raises(ArgumentError, match="lora-moe"):  # an unknown method is refused by the parser itself
        parser.parse_args(["--config", str(recipes / "common.yaml"), "--method", "lora-moe"])
