"""The k-means purity measurement (benchmarks/studies/kmeans_purity.py, issue 63): its scores against hand-computed
values, its features against the model's own hidden states, and one measurement on a tiny model."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from tiny_models import build_model, save_tiny_run_inputs, word_tokenizer

from benchmarks.studies import kmeans_purity as kmeans
from loramcl.data.prompts import encode_pairs


def test_purity_is_the_share_in_their_clusters_majority_mode_and_a_collapse_scores_chance():
    modes = [0] * 6 + [1] * 3 + [2] * 3
    clusters = np.array([2, 2, 2, 2, 2, 0] + [0, 0, 1] + [1, 1, 1])
    result = kmeans.purity(modes, clusters, 3)
    assert result["table"] == [[1, 0, 5], [2, 1, 0], [0, 3, 0]]  # [mode][cluster]
    assert result["purity"] == pytest.approx((2 + 3 + 5) / 12)  # each cluster's majority mode
    assert result["mode_purity"] == pytest.approx((5 + 2 + 3) / 12)  # each mode's most frequent cluster
    assert result["sizes"] == [5, 4, 3]
    relabelled = kmeans.purity(modes, np.array([1] * 6 + [2] * 3 + [0] * 3), 3)  # the modes under other ids
    assert relabelled["purity"] == relabelled["mode_purity"] == relabelled["nmi"] == pytest.approx(1.0)
    collapsed = kmeans.purity(modes, np.zeros(12, dtype=int), 3)  # one cluster: the largest mode's share
    assert collapsed["purity"] == pytest.approx(0.5) and collapsed["mode_purity"] == 1.0
    assert collapsed["nmi"] == pytest.approx(0.0) and collapsed["sizes"] == [12, 0, 0]


def test_features_are_the_means_over_the_target_positions_of_the_layers_outputs():
    torch.manual_seed(0)
    model, tokenizer = build_model("llama").eval(), word_tokenizer()  # 2 decoder layers: the middle is the first
    rows = [{"prompt": "w5 w20 w7", "target": "w40 w60 w41 w42"}, {"prompt": "w6", "target": "w41"},
            {"prompt": "w8 w9", "target": "w43 w61"}]
    features = kmeans.target_features(model, tokenizer, rows, batch_size=2)  # padded batches, sorted by length
    for i, pair in enumerate(encode_pairs(tokenizer, [r["prompt"] for r in rows], [r["target"] for r in rows])):
        with torch.no_grad():  # one row alone, unpadded; hidden_states: embeddings, layer 1, normed layer 2
            states = model(input_ids=torch.tensor([pair["input_ids"]]), output_hidden_states=True).hidden_states
        target = torch.tensor(pair["labels"]) != -100
        assert target.sum() == len(rows[i]["target"].split()) + 1  # the target's words and the end of sequence
        for kind, state in (("middle", states[1]), ("head-input", states[-1])):
            torch.testing.assert_close(torch.from_numpy(features[kind][i]), state[0, target].mean(0),
                                       rtol=1e-5, atol=1e-6)
    unnormed = copy.deepcopy(model)
    unnormed.model.norm = torch.nn.Identity()  # its output layer's input is then the last layer's own output
    np.testing.assert_allclose(features["last"], kmeans.target_features(unnormed, tokenizer, rows)["head-input"],
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(features["last"], features["head-input"])


@pytest.mark.filterwarnings("ignore:Number of distinct clusters")  # the tiny tokenizer reads the letters as one word
def test_the_measurement_runs_on_a_tiny_model(tmp_path, capsys, monkeypatch):
    base = save_tiny_run_inputs(tmp_path) / "base"
    results = kmeans.measure(base, ["markov"], tmp_path / "data", examples=24)
    assert [(r["kind"], r["scaling"]) for r in results] == [(k, s) for k in kmeans.KINDS for s in kmeans.SCALINGS]
    for r in results:
        assert r["K"] == 3 and r["examples"] == 24 and sum(r["sizes"]) == 24
        assert r["chance"] <= r["purity"] <= 1 and 0 <= r["nmi"] <= 1 and r["chance"] <= r["mode_purity"] <= 1
    modes = [json.loads(line)["mode"] for line in (tmp_path / "data/markov/train.jsonl").read_text().splitlines()]
    assert results[0]["chance"] == max(np.bincount(modes[:24])) / 24  # the study's own rows, its first 24
    assert kmeans.table(results).splitlines()[2].startswith("| markov | 3 | 24 | middle, raw | ")
    monkeypatch.setattr("sys.argv", ["kmeans_purity", "--model", str(base), "--tasks", "markov", "--examples", "24",
                                     "--data", str(tmp_path / "data"), "--json", str(tmp_path / "results.json")])
    kmeans.main()
    written = json.loads((tmp_path / "results.json").read_text())
    assert [{**r, "seconds": 0} for r in written] == [{**r, "seconds": 0} for r in json.loads(json.dumps(results))]
    assert capsys.readouterr().out.count("| markov | 3 | 24 |") == 6
