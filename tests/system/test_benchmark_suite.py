"""The benchmark suite (benchmarks/speed/suite.py): its shapes are the real models' (built on the meta device, never in
memory), it refuses runs that would mean nothing, and it runs end to end on a tiny shape."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from benchmarks.common import train_step, twin, use_grouped_conv
from benchmarks.speed import suite
from benchmarks.speed.suite_shapes import SHAPES, Suite, check_request
from loramcl import MCLConfig, get_mcl_model
from loramcl.mcl.layers import MCLLoraLinear


@pytest.mark.parametrize("name, parameters", [("llama-1b", 1.24e9), ("llama-8b", 8.03e9), ("qwen2-audio", 8.40e9)])
def test_gpu_shapes_have_the_real_models_sizes(name, parameters):
    shape = SHAPES[name]
    model = shape.build("meta", torch.bfloat16)  # shapes only: nothing is allocated
    assert shape.gpu
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(parameters, rel=0.005)
    assert min(shape.seqs) >= 64 and max(shape.seqs + shape.context_target) >= 256
    context, target = shape.context_target
    assert shape.family != "llama" or context == 8 * target  # the context:target 8:1
    if shape.audio_frames:  # the audio tokens the suite puts in the prompt are the encoder's output length
        assert shape.audio_tokens == model.model.audio_tower._get_feat_extract_output_lengths(
            torch.tensor(shape.audio_frames))[1].item() == 250


def test_refuses_runs_that_would_mean_nothing():
    with pytest.raises(ValueError, match="GPU shape.*--device cuda.*--allow-cpu"):
        check_request(SHAPES["llama-8b"], "cpu", "float32", allow_cpu=False)
    check_request(SHAPES["llama-8b"], "cpu", "float32", allow_cpu=True)
    with pytest.raises(ValueError, match="--dtype bfloat16 on the CPU.*float32"):
        check_request(SHAPES["cpu-small"], "cpu", "bfloat16", allow_cpu=False)
    with pytest.raises(ValueError, match="not a torch dtype"):
        check_request(SHAPES["cpu-small"], "cpu", "float33", allow_cpu=False)
    with pytest.raises(SystemExit):  # the command line says it as an argparse error
        suite.parse(["--shape", "llama-1b"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            check_request(SHAPES["llama-1b"], "cuda", "bfloat16", allow_cpu=False)


def test_twin_shares_the_frozen_base_and_leaves_it_unwrapped():
    base = SHAPES["tiny"].build("cpu", torch.float32)
    copy = twin(base)
    assert all(a is b for a, b in zip(base.parameters(), copy.parameters(), strict=True))
    assert copy.model.embed_tokens.weight is copy.lm_head.weight or not base.config.tie_word_embeddings
    get_mcl_model(copy, MCLConfig(num_hypotheses=2, target_modules=["q_proj"]))
    assert not any(isinstance(module, MCLLoraLinear) for module in base.modules())
    assert isinstance(copy.model.layers[0].self_attn.q_proj, MCLLoraLinear)
    assert copy.model.layers[0].self_attn.q_proj.base_layer.weight is base.model.layers[0].self_attn.q_proj.weight


def test_the_grouped_conv_variant_trains_a_bf16_base_beside_float32_adapters():
    """The suite on a GPU runs bf16 bases with float32 master adapters (issue 50: conv1d refused the mix, "Input type
    (CUDABFloat16Type) and weight type (torch.cuda.FloatTensor) should be the same"); the CPU refuses it alike."""
    tiny = Suite(SHAPES["tiny"], "cpu", torch.bfloat16)
    batch = tiny.batch(length=12, labelled=4, rows=2)
    stacked, _ = tiny.wrap(3)
    grouped, optimizer = tiny.wrap(3)
    use_grouped_conv(grouped)
    assert all(p.dtype == torch.float32 for p in grouped.parameters() if p.requires_grad)
    with torch.no_grad():
        assert torch.allclose(grouped(**batch).nll, stacked(**batch).nll, atol=0.05)  # bf16 rounding apart
    before = [p.detach().clone() for p in grouped.parameters() if p.requires_grad]
    train_step("grouped-conv", grouped, batch, optimizer)
    after = [p for p in grouped.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("name", ["tiny", "tiny-audio"])
def test_suite_runs_end_to_end_on_a_tiny_shape(name, tmp_path):
    lengths = ["--seqs", "16", "24"] if name == "tiny" else []  # two lengths: the models step on between them
    args = suite.parse(["--shape", name, "--steps", "1", "--repeats", "1", "--out", str(tmp_path), *lengths])
    results = suite.run(args)
    json_path, markdown_path = suite.write(results, tmp_path)
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(results))
    assert results["environment"]["device"] == "cpu" and results["environment"]["dtype"] == "float32"

    training = {(row["seq"], row["variant"], row["k"]): row for row in results["training"]}
    assert set(training) == {(seq, variant, k) for seq in args.seqs for variant, k in suite.TRAINING}
    for (seq, _, _), row in training.items():
        one = training[(seq, "stacked", 1)]
        assert row["time_ratio"] == pytest.approx(row["ms"] / one["ms"])
        assert row["tokens_per_s"] == pytest.approx(args.batch * (seq + SHAPES[name].audio_tokens)
                                                    / row["ms"] * 1000)
        assert math.isfinite(row["peak_mib"])

    if name == "tiny":
        context = {(row["variant"], row["k"]) for row in results["context_once"]}
        assert context == {(kind, k) for kind in ("full", "once") for k in suite.KS}
        peers = results["peers"]  # issue 40: every side decoded the same tokens as PEFT's mixed batch
        assert [(row["k"], row["batch"]) for row in peers] == [(k, batch) for k, _, _, batch in suite.PEERS]
        assert all(row["same_tokens"] == 1 and row["peft_over_loramcl"] > 0 for row in peers)
        assert "Against PEFT's mixed-adapter batches" in markdown_path.read_text()
    else:  # audio inputs are refused by the context computed once, and the suite says so
        assert "not measured" in results["context_once"] and "not measured" in results["peers"]
    decoding = results["decoding"]
    assert {(row["k"], row["strategy"], row["context"]) for row in decoding} >= {(5, "greedy", "full")}
    assert all(row["same_tokens"] == 1 and row["speedup"] > 0 for row in decoding)

    checked = {target["target"].split(": ", 1)[-1] for target in results["targets"]}
    assert any("two-pass" in target for target in checked) and any("never slower" in target for target in checked)
    assert any("batched / loop throughput >= 1.5" in target for target in checked)  # the CPU's target
    assert all(isinstance(target["met"], bool) for target in results["targets"])
    text = markdown_path.read_text()
    assert "| issue 18 target |" in text and "wta-two-pass" in text and "Decoding" in text


def test_the_peer_rows_asked_for_are_the_ones_measured(tmp_path):
    """--peers K/decoding/batch keeps a peer run short (one setting a run on a loaded machine); an unknown one is a
    command-line error."""
    args = suite.parse(["--shape", "tiny", "--sections", "peers", "--peers", "3/beam2/1", "--repeats", "1",
                        "--out", str(tmp_path)])
    rows = suite.run(args)["peers"]
    assert [(row["k"], row["strategy"], row["batch"]) for row in rows] == [(3, "beam 2/hypothesis", 1)]
    assert rows[0]["same_tokens"] == 1
    with pytest.raises(SystemExit):
        suite.parse(["--shape", "tiny", "--peers", "4/greedy/1"])


def test_the_compiled_rows_run_on_request_and_decode_eagers_tokens(tmp_path, monkeypatch):
    """--sections compiled (issue 54; not a CPU default): loramcl and the bare base, eager and compiled, side by side;
    compiled decoding gave eager decoding's tokens (the section checks it on the CPU). aot_eager: inductor's C++ build
    is not what is tested."""
    from loramcl.decoding import compiled

    assert "compiled" not in suite.parse(["--shape", "tiny"]).sections
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # the decoding rows' and the training rows
    torch._dynamo.reset()
    args = suite.parse(["--shape", "tiny", "--sections", "compiled", "--repeats", "1", "--out", str(tmp_path)])
    try:
        results = suite.run(args)
    finally:
        torch._dynamo.reset()
    rows = results["compiled"]
    decoding, training = rows[:2], rows[2:]
    assert [(row["k"], row["strategy"]) for row in decoding] == [(5, "greedy"), (5, "beam 2/hypothesis")]
    assert all(row["same_tokens"] == 1 and row["compiled_over_bare_compiled"] > 0 for row in decoding)
    # the training step, eager and compiled (the section checks their losses agree before timing)
    assert [(row["k"], row["training"]) for row in training] == [(1, True), (5, True)]
    assert all(row["compiled_over_eager"] > 0 for row in training)
    assert "Compiled decoding" in suite.markdown(results) and "eager and compiled:" in suite.markdown(results)


def test_the_indexed_routing_benchmark_checks_both_computations_agree_then_times_them(capsys, monkeypatch):
    """benchmarks/speed/indexed_routing.py on a small layer: the gather per index entry and the former gather per row
    give the same output (the script asserts it), then one row of timings each."""
    from benchmarks.speed import indexed_routing

    monkeypatch.setattr(sys, "argv", ["indexed_routing.py", "--width", "32", "--batch", "2", "--beams", "3",
                                      "--repeats", "2"])
    indexed_routing.main()
    printed = capsys.readouterr().out
    assert "| per entry (now) | 5 |" in printed and "| per row (before) | 30 |" in printed


def test_the_quantized_rows_run_end_to_end_on_the_tiny_shape(tmp_path):
    """`--quantized`: K = 5 two-pass MCL next to PEFT's K = 1 LoRA on each base, the quantized ones smaller."""
    pytest.importorskip("bitsandbytes")
    args = suite.parse(["--shape", "tiny", "--steps", "1", "--quantized", "--out", str(tmp_path), "--seqs", "8"])
    results = suite.run(args)
    json_path, markdown_path = suite.write(results, tmp_path)
    assert json_path.name == "suite-tiny-cpu-quantized.json" and "| nf4 | 8 |" in markdown_path.read_text()
    rows = {row["base"]: row for row in results["quantized"]}
    assert list(rows) == ["unquantized", "nf4", "int8", "torchao-int8"]
    for row in rows.values():
        assert row["model_mib"] > row["peft_model_mib"] and row["time_ratio"] == pytest.approx(
            row["ms"] / row["peft_ms"])
    assert rows["nf4"]["peft_model_mib"] < rows["int8"]["peft_model_mib"] < rows["unquantized"]["peft_model_mib"]
