"""The defaults study's scoring (benchmarks/studies/defaults_study.py, issue 53) against hand-computed values, and one
run of its pipeline (train, decode, score, win table by mode, reuse) on a tiny model."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
from tiny_models import save_tiny_run_inputs

from benchmarks.studies import defaults_study as study


def test_markov_candidates_are_valid_when_six_of_eight_transitions_are_one_chains_typical_ones():
    # chain 0 cycles a -> b -> c, chain 1 cycles backwards, chain 2 stays (each transition 0.8)
    assert study.markov_score("Sequence: a", " b c a b c a b c") == (True, 0)
    assert study.markov_score("Sequence: a", " c b a c b a c b") == (True, 1)
    assert study.markov_score("Sequence: b", " b b b b b b b b") == (True, 2)
    assert study.markov_score("Sequence: a", " b c a b c a a a") == (True, 0)  # 6 of 8 forward: still typical
    assert study.markov_score("Sequence: a", " b c a b c c c b") == (False, 0)  # 5 forward, 2 stays, 1 backward
    assert study.markov_score("Sequence: a", " b c a") == (False, None)  # not 8 states
    assert study.markov_score("Sequence: a", " b c a b c a b d") == (False, None)  # not a state


def test_scores_count_valid_answers_distinct_answers_and_languages():
    rows = [{"prompt": "Translate: Save\n", "references": ["Enregistrer", "Speichern", "Guardar"],
             "reference_modes": [0, 1, 2]},
            {"prompt": "Translate: Open\n", "references": ["Ouvrir", "Öffnen", "Abrir"], "reference_modes": [0, 1, 2]}]

    class ByWord:  # a stand-in identifier: the language of each known word
        languages = {"enregistrer": "fr", "speichern": "de", "ouvrir": "fr", "offnen": "de", "save": "en"}

        def predict(self, texts):
            return [self.languages.get(t.strip(" .").lower(), "es") for t in texts]

    candidates = [["Enregistrer", "speichern.", "Save"], ["Ouvrir", "Ouvrir", "Ouvrir"]]
    result = study.score("short", rows, candidates, ByWord())
    assert result["oracle"] == 1.0  # each prompt has a valid candidate
    assert result["mean"] == pytest.approx((2 / 3 + 1) / 2)
    assert result["distinct"] == 2.0  # 3 and 1
    assert result["modes_covered"] == 1.5  # fr + de (English is no target language), and fr


def test_mode_purity_and_the_logged_curve(tmp_path):
    assert study.mode_purity([[30, 2, 0], [1, 29, 2], [0, 3, 29]]) == pytest.approx(88 / 96)
    assert study.mode_purity([[10, 10], [10, 10]]) == 0.5
    log = [{"loss": 1.0, "step": 5, "win_rate_h0": 0.25, "win_rate_h1": 0.75, "nll_h0": 3.0, "nll_h1": 2.0,
            "split_gap": 0.5, "initial_nll": 4.0},
           {"loss": 0.9, "step": 10, "win_rate_h0": 0.5, "win_rate_h1": 0.5, "nll_h0": 2.0, "nll_h1": 2.0,
            "split_gap": 1.0}]
    (tmp_path / "train_log.json").write_text(json.dumps(log))
    curve = study.logged_curve(tmp_path)
    # gained = initial NLL - oracle NLL, the oracle being mean_k nll_h{k} - split gap: 4 - 2 = 2, then 4 - 1 = 3
    assert [c["step"] for c in curve] == [5, 10] and curve[0]["shares"] == [0.75, 0.25]
    assert curve[0]["gap_share"] == pytest.approx(0.25) and curve[1]["gap_share"] == pytest.approx(1 / 3)
    assert study.split_step(curve) == 5 and study.split_step(curve, threshold=0.3) == 10
    assert study.split_step([*curve, {**curve[0], "step": 15, "gap_share": 0.05}]) is None  # fell back under 10%


def test_every_setting_trains_as_many_parameters_as_the_one_lora():
    for setting in study.SETTINGS:
        for hypotheses in (2, 3):
            mcl, training = study.run_configs(setting, hypotheses, rank=8)
            assert mcl["r"] * mcl["num_hypotheses"] + mcl.get("shared_r", 0) == 8 * hypotheses, setting
            assert mcl["alpha"] == mcl["r"] + mcl.get("shared_r", 0)  # the adapters' scale alpha / rank stays 1
            assert set(training) <= set(study.TRAINING_KEYS) and not set(training) & set(mcl)
    assert study.run_configs("shared", 3, rank=8)[0] | {"loss": None, "epsilon": None} == {
        "num_hypotheses": 3, "r": 4, "alpha": 16.0, "shared_r": 12, "loss": None, "epsilon": None}
    assert study.run_configs("mle-loraplus", 3, rank=8) == ({"num_hypotheses": 1, "r": 24, "alpha": 24.0},
                                                          {"loraplus_lr_ratio": 16.0})


def test_one_run_trains_decodes_scores_and_is_reused(tmp_path):
    base = save_tiny_run_inputs(tmp_path) / "base"
    args = Namespace(model=base, out=tmp_path / "study", steps=2, learning_rate=1e-3, rank=4)
    study.build_task("markov", args.out / "data" / "markov", train=64, test=3)
    result = study.one_run(args, "markov", "relaxed-0.1", seed=0)
    assert result["K"] == 3 and set(result["test"]) == {"greedy"}
    assert sum(map(sum, result["wins_by_mode"])) == 64  # every training example (under 96) has one winner
    assert 0 <= result["test"]["greedy"]["oracle"] <= 1 and result["test"]["greedy"]["distinct"] >= 1
    run = args.out / "markov" / "relaxed-0.1-s0"
    assert json.loads((run / "run.json").read_text())["settings"]["mcl"]["epsilon"] == 0.1
    (run / "run.json").unlink()  # a finished run is read back, not trained again
    assert study.one_run(args, "markov", "relaxed-0.1", seed=0) == result
    mle = study.one_run(args, "markov", "mle", seed=0)
    assert set(mle["test"]) == {"beam", "sample", "greedy"} and "wins_by_mode" not in mle
    assert json.loads((args.out / "markov" / "mle-s0" / "run.json").read_text())["settings"]["mcl"]["r"] == 12
    # a run finished before greedy decoding of the one LoRA was added gets it on the next call, nothing else redone
    results = args.out / "markov" / "mle-s0" / "results.json"
    earlier = json.loads(results.read_text())
    del earlier["test"]["greedy"]
    results.write_text(json.dumps(earlier))
    assert study.one_run(args, "markov", "mle", seed=0) == mle
    shared = study.one_run(args, "markov", "combined", seed=0)  # a shared adapter, balanced WTA and LoRA+
    assert shared["trainable_parameters"] == mle["trainable_parameters"]  # K r + s = the one LoRA's rank
    assert "| markov | 3 | relaxed-0.1 | 1 |" in study.table(args.out)
    assert "| markov | 3 | LoRA-MLE r12, greedy 1 | 1 |" in study.table(args.out)
    assert study.curves(args.out).startswith("| task | setting | measure |")
    goal = study.goal_table(args.out).splitlines()
    assert goal[0] == "| setting | markov | bilingual | short | tasks met |"
    assert {line.split(" | ")[0] for line in goal[2:]} == {"| relaxed-0.1", "| combined"}  # the settings run


def test_the_goal_is_to_beat_beam_on_best_of_k_and_modes_with_a_mean_near_greedy(tmp_path):
    def write(task, setting, **test):
        (tmp_path / task / setting).mkdir(parents=True)
        (tmp_path / task / setting / "results.json").write_text(json.dumps(
            {"task": task, "setting": setting.rsplit("-s", 1)[0], "test": test}))

    scores = {"oracle": 0.5, "mean": 0.3, "distinct": 3, "modes_covered": 2.0}
    write("short", "mle-s0", beam=scores, greedy={**scores, "oracle": 0.3})
    write("short", "wta-s0", greedy={**scores, "oracle": 0.6, "modes_covered": 2.5, "mean": 0.24})  # 0.24 = 80%
    write("short", "bias-s0", greedy={**scores, "oracle": 0.5, "modes_covered": 2.5, "mean": 0.2})
    write("markov", "mle-s0", beam={**scores, "oracle": 1.0}, greedy={**scores, "oracle": 1.0})  # at the ceiling
    write("markov", "wta-s0", greedy={**scores, "oracle": 1.0, "modes_covered": 2.5, "mean": 0.8})
    write("markov", "bias-s0", greedy={**scores, "oracle": 1.0, "modes_covered": 2.0, "mean": 0.8})
    lines = study.goal_table(tmp_path).splitlines()[2:]
    assert lines == ["| wta | yes (best of K tied at its ceiling) | - | yes | 2 |",
                     "| bias | no: modes (best of K tied at its ceiling) | - | no: best of K, mean | 0 |"]


def test_the_verdicts_are_checked_against_the_split_by_mode():
    """benchmarks/studies/verdict_agreement.py: a run splits by mode when each hypothesis writes its own language at
    MODE_PURITY or more, the source language ("en") or empty answers owning nothing; each verdict's "split" counted
    against it."""
    from benchmarks.studies.verdict_agreement import split_by_mode, table

    own = [["fr", "de"]] * 8 + [["fr", "fr"]] * 2  # h1: de on 8 of 10
    assert split_by_mode(own) == (True, ["fr", "de"], [1.0, 0.8])
    assert split_by_mode([["fr", "de"]] * 6 + [["de", "fr"]] * 4)[0] is False  # 0.6 < MODE_PURITY
    assert split_by_mode([["en", "fr"]] * 10)[0] is False  # copying the source is no mode of its own
    rows = [{"task": "short", "setting": s, "seed": 0, "split": split, "majority": ["fr", "de"], "purity": [1.0, 0.8],
             "nll_verdict": nll, "output_verdict": out, "output_majority": ["fr", "de"], "same_rate": 0.1,
             "copy_rate": 0.0}
            for s, split, nll, out in (("a", True, "split", "split by mode"), ("b", False, "split", "differ"))]
    assert table(rows).splitlines()[-1] == (
        '2 runs, 1 split by mode. The NLL verdict agrees on 1 (said "split" on 1 that did not split by mode); the '
        'output verdict agrees on 2 (said "split by mode" on 0 that did not). Of the 1 that split by mode, the output '
        'verdict said "split by mode" on 1, the NLL verdict "split" on 1.')
    budget = [dict(rows[1], budget=200, trained_verdict="split by mode")]  # a budget-study run: its own verdict too
    lines = table(budget).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 9 and "| 200 | no (" in lines[2]
    assert lines[-1].endswith('The verdict the 1 budget-study runs gave themselves in training agrees on 0 (said '
                              '"split by mode" on 1 that did not).')


def test_on_the_markov_task_an_answers_mode_is_the_chain_it_follows(tmp_path):
    """verdict_agreement on a budget-study Markov run: each answer's mode is its chain (markov_score), the references
    are the drawn sequences of references.jsonl, each of its chain; a run whose hypotheses each write one chain of
    their own split by mode, and the output verdict sees it."""
    from benchmarks.studies.verdict_agreement import chain, run_verdicts, split_by_mode

    assert chain("Sequence: a", " b c a b c a b c") == "chain 0" and chain("Sequence: a", " b c a") == "invalid"
    assert split_by_mode([["chain 0", "invalid"]] * 3)[0] is False  # writing no chain is no mode of its own
    forward = {"a": " b c a b c a b c", "b": " c a b c a b c a", "c": " a b c a b c a b"}
    backward = {"a": " c b a c b a c b", "b": " a c b a c b a c", "c": " b a c b a c b a"}
    data, prompts = tmp_path / "data" / "markov", [f"Sequence: {state}" for state in "abc"]
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("".join(json.dumps({"prompt": p, "references": []}) + "\n" for p in prompts))
    assert run_verdicts(tmp_path) == []  # the defaults study's Markov data: no drawn references, no row
    (data / "references.jsonl").write_text("".join(json.dumps(
        {"prompt": p, "references": [forward[p[-1]], backward[p[-1]]]}) + "\n" for p in prompts))
    run = tmp_path / "markov" / "200-steps" / "bias-0.1-s1"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"setting": "bias-0.1", "seed": 1, "budget": 200, "best_step": 200,
                                                  "verdict": {"kind": "split"}}))
    answers = {"greedy": [[forward[p[-1]], backward[p[-1]]] for p in prompts]}
    (run / "candidates.json").write_text(json.dumps(answers))
    [row] = run_verdicts(tmp_path)
    assert (row["split"], row["majority"], row["output_verdict"]) == (True, ["chain 0", "chain 1"], "split by mode")
    answers["greedy"] = [[forward[p[-1]], forward[p[-1]]] for p in prompts]  # both write the forward cycle
    (run / "candidates.json").write_text(json.dumps(answers))
    [row] = run_verdicts(tmp_path)
    assert (row["split"], row["output_verdict"]) == (False, "write the same")


def test_the_skewed_markov_task_draws_its_chains_60_30_10(tmp_path):
    """markov-skewed: the Markov task's chains drawn with MARKOV_WEIGHTS, scored as the Markov task."""
    from collections import Counter

    rows = study.markov_rows(2000, seed=0, weights=study.MARKOV_WEIGHTS["markov-skewed"])
    shares = {mode: count / len(rows) for mode, count in Counter(r["mode"] for r in rows).items()}
    assert shares == pytest.approx({0: 0.6, 1: 0.3, 2: 0.1}, abs=0.03)
    assert all(study.markov_score(r["prompt"], r["target"])[1] is not None for r in rows)  # 8 states each
    equal = Counter(r["mode"] for r in study.markov_rows(2000, seed=0))
    assert min(equal.values()) > 600  # the Markov task's: equal weights
    study.build_task("markov-skewed", tmp_path, 300, 3)
    assert study.read_rows(tmp_path / "test.jsonl") == study.markov_prompts()
    assert study.is_markov("markov-skewed") and not study.is_markov("short")
