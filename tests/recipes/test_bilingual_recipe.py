"""`loramcl bilingual --quick`: the whole recipe (real SmolLM2-135M, real catalogs) on a few examples and steps,
then again to check that finished stages are reused."""

import hashlib
import json
import math

import pytest

from loramcl.recipes.bilingual.reproduce import bilingual

RUNS = ("mle", "mcl-relaxed", "mcl-annealed")
# a quick run decodes the first system of each (run, strategy) of the recipe's grid (recipe.grid)
SYSTEMS = ("mle-beam-b2", "mle-diversebeam-b2", *(f"mcl-{loss}-{decoding}-b2" for loss in ("relaxed", "annealed")
                                                  for decoding in ("beam", "greedy", "diversebeam")))


@pytest.fixture(scope="module")
def quick(tmp_path_factory, smollm2_folder):
    out = tmp_path_factory.mktemp("bilingual")
    (out / "SmolLM2-135M-Instruct").symlink_to(smollm2_folder)  # converted once per test session
    return out, bilingual(out=str(out), quick=True, threads=1)


def test_quick_recipe_writes_every_output(quick):
    out, report = quick
    assert sorted(report["systems"]) == sorted(SYSTEMS) and set(report["runs"]) == set(RUNS)
    for name, result in report["systems"].items():
        for metric in ("sacrebleu", "chrf", "mbleu4", "div2"):
            assert math.isfinite(result["metrics"][metric]), (name, metric)
        assert math.isfinite(result["likelihood"]["oracle_nll"])
        for share in result["languages"]["per_hypothesis"]:
            assert sum(share.values()) == pytest.approx(1.0)
        assert set(result["language_wins"]["by_group"]) == {"fr", "de"}
    for name in ("mcl-relaxed-greedy-b2", "mcl-relaxed-diversebeam-b2", "mcl-annealed-beam-b2"):  # scored MCL runs
        metrics, scores = report["systems"][name]["metrics"], report["systems"][name]["mean_scores"]
        assert sum(scores) == pytest.approx(1.0) and 0 <= metrics["score_top1"] <= 1 and 0 <= metrics["score_ece"] <= 1
        assert metrics["mixture_nll"] >= metrics["oracle_nll"] - 1e-9  # min_k -log p_k <= -log sum_k p(k|c) p_k
    assert "mean_scores" not in report["systems"]["mle-beam-b2"]
    references = sum(len(json.loads(line)["references"]) for line in (out / "data" / "test.jsonl").open())
    assert set(report["likelihood"]) == set(RUNS)  # oracle NLL per run (paper Table 1) and the paper's winner
    for run in ("mcl-relaxed", "mcl-annealed"):  # the hypothesis a reference is most likely under
        row = report["likelihood"][run]
        wins = row["likelihood_wins"]
        assert set(wins["by_group"]) == {"fr", "de"} and wins["win_rate"] == pytest.approx(row["win_rate"])
        assert wins["num_items"] == row["num_references"] == references  # every reference counted once
        assert row["oracle_nll"] <= min(row["hypothesis_nll"])
    # equal trainable counts but for the scores head of the MCL runs: K x (SmolLM2's hidden size 576 + a bias)
    trainable = {run: report["runs"][run]["trainable_parameters"] for run in RUNS}
    assert trainable["mcl-relaxed"] == trainable["mcl-annealed"] == trainable["mle"] + 2 * (576 + 1)
    # the identifier is trained and checked on the real catalogs, so its accuracy means something even here
    assert report["identifier"]["accuracy"] > 0.9
    for path in report["figures"].values():
        assert (out / "figures" / path.rsplit("/", 1)[-1]).stat().st_size > 1000
    markdown = (out / "report.md").read_text()
    assert "paper Table 7" in markdown and "SVM test accuracy" in markdown and "Hypothesis scores" in markdown
    assert "the paper's winner" in markdown
    assert json.loads((out / "report.json").read_text())["systems"].keys() == report["systems"].keys()


def test_a_second_run_reuses_the_finished_stages(quick):
    out, first = quick
    again = bilingual(out=str(out), quick=True, threads=1)
    assert set(again["timing_s"]) == {"convert model", "report", "runs"}  # nothing retrained or decoded
    for run in RUNS:  # each run records the hash of the data it was trained on: a rebuilt dataset retrains it
        recorded = json.loads((out / run / "run.json").read_text())["settings"]["data_sha256"]
        assert recorded["train"] == hashlib.sha256((out / "data" / "train.jsonl").read_bytes()).hexdigest()
    name = "mcl-annealed-greedy-b2"
    assert again["systems"][name]["metrics"] == first["systems"][name]["metrics"]
