"""QLoRA-MCL on a real model: SmolLM2-135M in nf4 trains the bilingual task's quick run with the packaged recipe's
command (`loramcl train --config bilingual/common.yaml --config bilingual/mcl-relaxed.yaml --quantization nf4`),
then decodes its K hypotheses on the same quantized base."""

import json
import math
import warnings

import pytest

from loramcl.cli import main
from loramcl.recipes.bilingual.reproduce import QUICK_TRAIN, bilingual

pytest.importorskip("bitsandbytes")


def test_smollm2_in_nf4_trains_the_bilingual_quick_run(tmp_path, monkeypatch, smollm2_folder):
    from transformers import AutoTokenizer

    from loramcl.decoding import generate_hypotheses
    from loramcl.mcl.quantization import BNB_4BIT, quantization_backend
    from loramcl.models import load_model
    from loramcl.utils.inputs import BaseWeightsMismatch

    out = tmp_path / "runs" / "bilingual"
    out.mkdir(parents=True)
    (out / "SmolLM2-135M-Instruct").symlink_to(smollm2_folder)
    bilingual(out=str(out), quick=True, stop_after="data", threads=1)
    monkeypatch.chdir(tmp_path)
    quick = [f"--training.{key}={value}" for key, value in QUICK_TRAIN["training"].items()]
    main(["train", "--config", "bilingual/common.yaml", "--config=bilingual/mcl-relaxed.yaml", "--quantization", "nf4",
          "--data.eval_examples", "4", "--threads", "1", *quick])
    run = out / "mcl-relaxed"
    record = json.loads((run / "run.json").read_text())
    assert record["settings"]["quantization"] == "nf4" and record["settings"]["mcl"]["num_hypotheses"] == 2
    losses = [entry["loss"] for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseWeightsMismatch)  # the same nf4 base as in training
        mcl = load_model(str(smollm2_folder), str(run), quantization="nf4")
    assert quantization_backend(mcl.base_model.model.layers[0].self_attn.q_proj.base_layer) == BNB_4BIT
    prompt = json.loads((out / "data" / "test.jsonl").open().readline())["prompt"]
    candidates = generate_hypotheses(mcl, AutoTokenizer.from_pretrained(smollm2_folder), [prompt], max_new_tokens=6)
    assert [candidate.hypothesis for candidate in candidates[0]] == [0, 1]
    assert all(candidate.token_ids for candidate in candidates[0])
