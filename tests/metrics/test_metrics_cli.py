"""`loramcl evaluate` / `loramcl plot-tradeoff`: files in, JSON + markdown + plot out, clear errors on bad files."""

import contextlib
import io
import json
from pathlib import Path

import pytest
from jsonargparse import CLI

from loramcl.metrics.evaluate import evaluate, plot_tradeoff
from loramcl.metrics.io import load_run

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
PREDS, REFS = str(FIXTURES / "preds.jsonl"), str(FIXTURES / "refs.jsonl")


def run_cli(*args):
    """Parse like `loramcl` does (jsonargparse, as_positional=False) and run."""
    return CLI({"evaluate": evaluate, "plot-tradeoff": plot_tradeoff}, args=list(args), as_positional=False)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """Every metric on the 6-item fixture, K = 3, R = 3, with an NLL file: SPICE and SPIDEr are not computed (no
    CoreNLP jars offline), which the captioning preset reports instead of failing."""
    out = tmp_path_factory.mktemp("eval")
    nll = out / "nll.jsonl"
    with nll.open("w") as f:
        for i, item in enumerate(["a1", "a2", "a3", "a4", "a5", "a6"]):
            french = i >= 3  # h0 explains the French references best, h1 the English ones
            f.write(json.dumps({"id": item, "nll": [[1.0, 2.0, 3.0] if french else [2.5, 1.5, 3.0]] * 3}) + "\n")
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.delenv("LORAMCL_SPICE_DIR", raising=False)
        paths = run_cli("evaluate", "--predictions", PREDS, "--references", REFS, "--metrics",
                        "captioning,translation", "--group_key", "lang", "--nll", str(nll), "--out", str(out),
                        "--name", "run_a")
    return paths, json.loads(Path(paths["json"]).read_text()) | {"stderr": stderr.getvalue()}


def test_evaluate_writes_every_metric(full_run):
    paths, report = full_run
    expected = ["bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider_d", "sbert_sim", "div1", "div2",
                "mbleu4", "loo_bleu", "pairwise_bleu", "refs_covered", "oracle_nll", "oracle_ppl"]
    assert list(report["metrics"]) == expected
    assert all(0 <= report["metrics"][m] <= 1 for m in ["bleu4", "meteor", "rouge_l", "div2", "mbleu4"])
    assert report["num_items"] == 6 and report["num_candidates"] == 3
    assert report["metrics"]["oracle_nll"] == pytest.approx(1.25)  # (1.0 * 3 + 1.5 * 3) / 6 per item
    markdown = Path(paths["markdown"]).read_text()
    assert "| cider_d |" in markdown and "| fr | 3 |" in markdown and "| h0 | " in markdown
    # the preset's SPICE and SPIDEr: not computed, with the reason, in the report and in one line on stderr
    assert set(report["unavailable"]) == {"spice", "spider"}
    assert report["unavailable"]["spice"].startswith("SPICE is not set up. SPICE needs Stanford CoreNLP 3.6.0")
    assert "| spice, spider | not computed | | | SPICE is not set up." in markdown
    assert report["stderr"].splitlines()[-1] == (
        "loramcl evaluate: not computed: spice, spider: SPICE is not set up (the report says how to set it up; "
        "--exclude spice,spider leaves them out)")
    items = [json.loads(line) for line in Path(paths["items"]).read_text().splitlines()]
    assert [i["id"] for i in items] == ["a1", "a2", "a3", "a4", "a5", "a6"]
    assert len(items[0]["scores"]["cider_d"]) == 3


def test_specialisation_per_language(full_run):
    _, report = full_run
    spec = report["specialisation"]
    assert spec["metric"] == "cider_d" and set(spec["by_group"]) == {"en", "fr"}
    # a4-a6: the only French candidate (h0) matches the French references
    assert spec["by_group"]["fr"]["win_rate"] == [1.0, 0.0, 0.0]
    assert spec["nll_win_rate"] == pytest.approx([0.5, 0.5, 0.0])


def test_cli_parses_lists_and_plots(tmp_path, capsys, full_run):
    run_cli("evaluate", "--predictions", PREDS, "--references", REFS, "--metrics", "bleu4,cider_d,div2,mbleu4",
            "--out", str(tmp_path), "--name", "run_b")
    assert "metrics (JSON):" in capsys.readouterr().out
    first = full_run[0]["json"]
    png = tmp_path / "tradeoff.png"
    run_cli("plot-tradeoff", "--runs", f"{first},{tmp_path / 'run_b.json'}", "--x", "mbleu4", "--y", "cider_d",
            "--out", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot (2 runs, x=mbleu4, y=cider_d): {png}" in capsys.readouterr().out
    run_cli("plot-tradeoff", "--runs", str(tmp_path / "*.json"), "--x", "div2", "--y", "bleu4", "--out", str(png))
    with pytest.raises(ValueError, match=r"run 'run_b' has no \['loo_bleu'\]"):
        plot_tradeoff([first, str(tmp_path / "run_b.json")], x="mbleu4", y="loo_bleu", out=str(png))


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mismatched_and_duplicate_ids_are_named(tmp_path):
    preds = write(tmp_path / "p.jsonl", [{"id": 1, "candidates": ["a"]}, {"id": "x", "candidates": ["b"]}])
    refs = write(tmp_path / "r.jsonl", [{"id": "1", "references": ["a"]}, {"id": "x", "references": ["b"]}])
    with pytest.raises(ValueError, match=r"ids in predictions but not in refer.*: 1;.*: '1' \(some differ only in"):
        load_run(preds, refs)
    dup = write(tmp_path / "d.jsonl", [{"id": 1, "candidates": ["a"]}, {"id": 1, "candidates": ["b"]}])
    with pytest.raises(ValueError, match="duplicate ids .*: 1"):
        load_run(dup, refs)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"id": 1, "candidates": ["a"]}\n{"id": 2, "cands": ["a"]}\n')
    with pytest.raises(ValueError, match=r'b.jsonl:2 must be an object with "candidates"; its fields are "id", '):
        load_run(str(bad), refs)
    not_a_list = write(tmp_path / "s.jsonl", [{"id": 1, "candidates": "a"}])
    with pytest.raises(ValueError, match='"candidates" must be a non-empty list of strings; not so for ids 1'):
        load_run(not_a_list, write(tmp_path / "t.jsonl", [{"id": 1, "references": ["a"]}]))
    for empty in ([], [""], " "):  # an empty reference would score every candidate 0
        with pytest.raises(ValueError, match='e.jsonl:2: "references" must be a non-empty text or list of non-empty '
                                             "texts$"):
            load_run(write(tmp_path / "c.jsonl", [{"id": 2, "candidates": ["a"]}, {"id": 1, "candidates": ["a"]}]),
                     write(tmp_path / "e.jsonl", [{"id": 2, "references": ["a"]}, {"id": 1, "references": empty}]))
    plain_preds = write(tmp_path / "u.jsonl", [{"id": 1, "candidates": ["a"]}])
    plain_refs = write(tmp_path / "v.jsonl", [{"id": 1, "references": ["a"]}])
    with pytest.raises(ValueError, match="id 1 has no \"lang\" field"):
        load_run(plain_preds, plain_refs, group_key="lang")


def test_unknown_metric_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['bleu5'\]; presets: \['captioning', 'short_answers', 'translation'\]"):
        evaluate(PREDS, REFS, metrics="bleu5", out=str(tmp_path))


def test_bad_options_fail_before_any_computation():
    from loramcl.metrics import evaluate_candidates

    cands, refs = [["a dog", "a cat"], ["a man", "a horse"]], [["a dog"], ["a man"]]
    with pytest.raises(ValueError, match=r"winner_metric 'meteor' is not a candidate-level metric.*\['bleu4', 'sacre"):
        evaluate_candidates(cands, refs, metrics="bleu4,div2", winner_metric="meteor")
    with pytest.raises(ValueError, match="3 group labels for 2 items"):
        evaluate_candidates(cands, refs, metrics="bleu4", groups=["a", "b", "c"])
    with pytest.raises(ValueError, match="no metric left"):
        evaluate_candidates(cands, refs, metrics="translation", exclude="loo_bleu,pairwise_bleu,refs_covered")


@pytest.mark.parametrize("rows, message", [
    ([[1.0, 2.0, 3.0, 4.0]] * 3, r"p.jsonl: id 'a1': NLL under 4 hypotheses for 3 candidates"),  # phantom h3
    ([[1.0, 2.0, 3.0]] * 4, r"id 'a1': 4 NLL rows for 3 references"),
    ([[1.0, -2.0, 3.0]] * 3, r"id 'a1': NLL values must be finite and >= 0"),
    ([[1.0, 2.0, 3.0], [1.0, 2.0], [1.0, 2.0, 3.0]], r"id 'a1': its references have NLL rows of different lengths"),
    ([[1.0, "x", 3.0]] * 3, r'id \'a1\': "nll" must hold numbers only'),
    ([], r'id \'a1\': "nll" must be a non-empty list'),
])
def test_nll_files_that_do_not_match_the_run_are_refused(tmp_path, rows, message):
    items = ["a1", "a2", "a3", "a4", "a5", "a6"]
    good = [[1.0, 2.0, 3.0]] * 3
    nll = write(tmp_path / "p.jsonl", [{"id": item, "nll": rows if item == "a1" else good} for item in items])
    with pytest.raises(ValueError, match=message):
        evaluate(PREDS, REFS, metrics="bleu1", nll=nll, out=str(tmp_path), tokenize=False)


def test_a_single_model_nll_column_is_accepted_for_its_k_candidates(tmp_path):
    items = ["a1", "a2", "a3", "a4", "a5", "a6"]
    nll = write(tmp_path / "n.jsonl", [{"id": item, "nll": [[1.5]] * 3} for item in items])
    paths = evaluate(PREDS, REFS, metrics="bleu1", nll=nll, out=str(tmp_path), tokenize=False)
    assert json.loads(Path(paths["json"]).read_text())["metrics"]["oracle_nll"] == pytest.approx(1.5)


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"id": 1, "candidates": ["a"]}\n{"id": 2, "candidates": ["caf\u00e9"]}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl:2 is not UTF-8 text \(byte 0xe9"):
        load_run(str(bad), REFS)


def test_a_byte_order_mark_at_the_start_of_a_file_is_accepted_and_elsewhere_named(tmp_path):
    """Editors on Windows (Notepad, Excel's "UTF-8 CSV") start UTF-8 files with a byte-order mark: on purpose, it is
    read as the start of the file, with the same report as the file without it. A mark inside the file is an error
    naming the line."""
    marked = {}
    for name, path in (("preds", PREDS), ("refs", REFS)):
        marked[name] = tmp_path / f"{name}.jsonl"
        marked[name].write_bytes(b"\xef\xbb\xbf" + Path(path).read_bytes())
    plain = evaluate(PREDS, REFS, metrics="bleu1", out=str(tmp_path / "plain"), tokenize=False)
    with_mark = evaluate(str(marked["preds"]), str(marked["refs"]), metrics="bleu1", out=str(tmp_path / "bom"),
                         tokenize=False)
    assert json.loads(Path(with_mark["json"]).read_text())["metrics"] == \
        json.loads(Path(plain["json"]).read_text())["metrics"]
    lines = Path(PREDS).read_bytes().splitlines(keepends=True)
    inside = tmp_path / "inside.jsonl"
    inside.write_bytes(lines[0] + b"\xef\xbb\xbf" + b"".join(lines[1:]))
    with pytest.raises(ValueError, match=r"inside.jsonl:2 starts with a byte-order mark \(U\+FEFF\), which only "):
        load_run(str(inside), REFS)


def test_the_docs_pipeline_reads_one_test_file_without_ids(tmp_path, capsys):
    """docs/guide/cli.md's pipeline: `loramcl generate`, `loramcl nll` and `loramcl evaluate --metrics translation` read
    the same test file, whose lines have no id (each numbered by its position, the same way by the three commands)
    and 1 to 3 references, one of them given as a string."""
    from conftest import wrapped_model
    from tiny_models import word_tokenizer

    from loramcl.cli import main
    from loramcl.metrics import loo_bleu

    mcl, base, _, _ = wrapped_model("llama", num_hypotheses=2)  # a tiny Llama, adapters made different
    base.save_pretrained(tmp_path / "tiny")
    word_tokenizer().save_pretrained(tmp_path / "tiny")
    mcl.save_pretrained(tmp_path / "run")
    test = write(tmp_path / "test.jsonl", [
        {"prompt": "w5 w6 w7", "references": ["w8 w9 w10", "w8 w11", "w12 w9 w10"]},
        {"prompt": "w9", "references": "w10 w11 w12"},
        {"prompt": "w10 w11 w12", "references": ["w13 w14", "w15 w13 w14"]},
    ])
    model, run = ["--model", str(tmp_path / "tiny")], ["--adapters", str(tmp_path / "run")]
    main(["generate", *model, *run, "--input", test, "--out", str(tmp_path / "preds.jsonl"), "--max_new_tokens", "4",
          "--progress", "false"])
    main(["nll", *model, *run, "--input", test, "--out", str(tmp_path / "nll.jsonl")])
    capsys.readouterr()
    main(["evaluate", "--predictions", str(tmp_path / "preds.jsonl"), "--references", test, "--nll",
          str(tmp_path / "nll.jsonl"), "--metrics", "translation", "--out", str(tmp_path / "eval"), "--name", "mcl"])
    report = json.loads((tmp_path / "eval" / "mcl.json").read_text())
    assert list(report["metrics"]) == ["loo_bleu", "pairwise_bleu", "refs_covered", "oracle_nll", "oracle_ppl"]
    assert report["num_items"] == 3 and report["references_per_item"] == {"min": 1, "max": 3, "mean": 2.0}
    predictions = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    nll = [json.loads(line) for line in (tmp_path / "nll.jsonl").read_text().splitlines()]
    assert [p["id"] for p in predictions] == [n["id"] for n in nll] == [0, 1, 2]
    assert [len(n["nll"]) for n in nll] == [3, 1, 2]  # one row per reference, the string one included
    # Loo-BLEU over the items with two references or more; the one with a single reference is named
    expected = loo_bleu([predictions[0]["candidates"], predictions[2]["candidates"]],
                        [["w8 w9 w10", "w8 w11", "w12 w9 w10"], ["w13 w14", "w15 w13 w14"]])["loo_bleu"]
    assert report["metrics"]["loo_bleu"] == pytest.approx(expected)
    assert report["notes"]["loo_bleu"].startswith("over the 2 of 3 items with >= 2 references")
    assert capsys.readouterr().err.splitlines() == [
        "loramcl evaluate: note: loo_bleu is over the 2 of 3 items with >= 2 references; the 1 with one reference "
        "are left out (holding out their only reference leaves nothing to score against); their ids: 1"]
