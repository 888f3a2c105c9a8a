"""Image captioning (paper §4.3, App. H.2): the TextCaps reader on files in the official layout, the LLaVA-NeXT
conversation and labels through the processor, anyres images of different sizes in one batch."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from loramcl.recipes.image_captioning.textcaps import CaptionTrainingSet, read_textcaps

# image id -> (height, width, its captions); the first two images have several references.
IMAGES = {"011e7e629fb9ae7b": (20, 12, ["a red sign that says stop", "a sign that says stop on a street",
                                        "red stop sign near a store front"]),
          "0a5b6f3e8c1d2e4f": (12, 40, ["a bottle of beer on a table", "a green bottle of coffee brand"]),
          "1c2d3e4f5a6b7c8d": (16, 16, ["a man holding a phone"])}
TEST_IMAGES = {"9f8e7d6c5b4a3210": (24, 14)}


def write_textcaps(root: Path, images=IMAGES, test_images=TEST_IMAGES, flat: bool = False) -> Path:
    """TextCaps_0.1_{train,val,test}.json as the official files are (one item per caption, each carrying the image's
    reference_strs; the test split without captions) and the images, generated, under root/images/<split>/ (or
    flat under root/images/ as TextVQA's train_images/)."""
    rng = np.random.default_rng(0)

    def image(split: str, image_id: str, height: int, width: int) -> str:
        path = root / "images" / ("" if flat else split) / f"{image_id}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
        return f"{split}/{image_id}.jpg"

    def item(split: str, image_id: str, height: int, width: int) -> dict:
        return {"image_id": image_id, "image_classes": ["Street sign"], "flickr_original_url": "", "image_width": width,
                "image_height": height, "set_name": split, "image_name": image_id,
                "image_path": image(split, image_id, height, width)}

    train = [item("train", i, h, w) | {"caption_id": n, "caption_str": c, "caption_tokens": c.split(),
                                       "reference_strs": refs, "reference_tokens": [r.split() for r in refs]}
             for i, (h, w, refs) in images.items() for n, c in enumerate(refs)]
    test = [item("test", i, h, w) for i, (h, w) in test_images.items()]
    for split, data in (("train", train), ("val", train), ("test", test)):
        (root / f"TextCaps_0.1_{split}.json").write_text(json.dumps(
            {"dataset_type": split, "dataset_name": "textcaps", "dataset_version": "0.1", "data": data}))
    return root


def test_reader_groups_the_items_of_an_image_with_all_its_references(tmp_path):
    root = write_textcaps(tmp_path)
    images = read_textcaps(root / "TextCaps_0.1_train.json", root / "images")
    assert [i.image_id for i in images] == list(IMAGES)
    assert [i.references for i in images] == [refs for _, _, refs in IMAGES.values()]
    assert images[0].image_path == root / "images" / "train" / "011e7e629fb9ae7b.jpg"
    test = read_textcaps(root / "TextCaps_0.1_test.json", root / "images")
    assert [(i.image_id, i.references) for i in test] == [("9f8e7d6c5b4a3210", [])]
    with pytest.raises(ValueError, match="caption_str"):
        read_textcaps(root / "TextCaps_0.1_test.json", root / "images", captions=True)
    with pytest.raises(ValueError, match="training needs captions: image '9f8e7d6c5b4a3210'"):
        CaptionTrainingSet(test)
    # TextVQA's flat train_images/ folder: the file name is found without the split prefix
    flat = write_textcaps(tmp_path / "flat", flat=True)
    assert read_textcaps(flat / "TextCaps_0.1_train.json", flat / "images")[1].image_path.parent == flat / "images"


def test_training_examples_per_reference_or_one_drawn_per_image_and_epoch(tmp_path):
    images = read_textcaps(write_textcaps(tmp_path) / "TextCaps_0.1_train.json", tmp_path / "images")
    every = CaptionTrainingSet(images)
    assert len(every) == 6
    assert [(image.image_id, caption) for image, caption in (every[i] for i in range(6))] == [
        (i, c) for i, (_, _, refs) in IMAGES.items() for c in refs]
    one = CaptionTrainingSet(images, per_image="one", seed=3)
    assert len(one) == 3

    def draws(dataset, epoch):
        dataset.set_epoch(epoch)
        return [dataset[i][1] for i in range(len(dataset))]

    epochs = [draws(one, e) for e in range(12)]
    assert epochs[4] == draws(CaptionTrainingSet(images, per_image="one", seed=3), 4)  # reproducible
    assert all(draw[i] in IMAGES[key][2] for draw in epochs for i, key in enumerate(IMAGES))
    assert len({d[0] for d in epochs}) == 3  # every reference of the first image is drawn in some epoch
    assert len({tuple(d) for d in epochs}) > 1
    with pytest.raises(ValueError, match="per_image"):
        CaptionTrainingSet(images, per_image="some")
    # finetune.fit tells the dataset Trainer's epoch at each epoch's start (resumed mid-epoch too)
    import types

    from loramcl.training.fit import _epoch_callback

    for epoch, expected in ((0, 0), (1.0, 1), (2.5, 2)):
        _epoch_callback(one).on_epoch_begin(None, types.SimpleNamespace(epoch=epoch), None)
        assert one.epoch == expected


def test_reader_errors_name_the_file_and_the_item(tmp_path):
    root = write_textcaps(tmp_path)
    train = root / "TextCaps_0.1_train.json"
    broken = tmp_path / "broken.json"
    broken.write_text('{"data": [\n{"image_id": "x",\n}')
    with pytest.raises(ValueError, match=r"broken.json is not valid JSON \(line 3"):
        read_textcaps(broken, root / "images")
    broken.write_text('[{"image_id": "x"}]')
    with pytest.raises(ValueError, match='must hold a JSON object with a "data" list'):
        read_textcaps(broken, root / "images")
    data = json.loads(train.read_text())
    data["data"][2]["caption_str"] = ""
    broken.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"item 2 of \"data\" \(image_id '011e7e629fb9ae7b'\): \"caption_str\""):
        read_textcaps(broken, root / "images")
    data = json.loads(train.read_text())
    del data["data"][3]["image_path"]
    broken.write_text(json.dumps(data))
    with pytest.raises(ValueError, match='item 3 of "data" needs "image_path"'):
        read_textcaps(broken, root / "images")
    (root / "images" / "train" / "0a5b6f3e8c1d2e4f.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="image_id '0a5b6f3e8c1d2e4f'.*not found under"):
        read_textcaps(train, root / "images")
    (root / "images" / "train" / "0a5b6f3e8c1d2e4f.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(ValueError, match="image_id '0a5b6f3e8c1d2e4f'.*is not a readable image"):
        read_textcaps(train, root / "images")
    assert len(read_textcaps(train, root / "images", check_images=False)) == 3


def test_caption_labels_are_the_caption_and_eos_after_the_expanded_image_tokens(tmp_path):
    from tiny_models import IMAGE_TOKEN, llava_next_processor

    from loramcl.recipes.image_captioning.prompts import DEFAULT_INSTRUCTION, CaptionEncoder

    processor = llava_next_processor()
    images = read_textcaps(write_textcaps(tmp_path) / "TextCaps_0.1_train.json", tmp_path / "images")
    encoder = CaptionEncoder(processor)
    assert DEFAULT_INSTRUCTION in encoder.prompt and encoder.prompt.endswith("ASSISTANT:")
    tokenizer = processor.tokenizer
    for image in images[:2]:  # 20x12 and 12x40 pixels: different numbers of anyres image tokens
        row = encoder(image, image.references[1])
        picture = Image.open(image.image_path).convert("RGB")
        prompt = processor(images=[picture], text=[encoder.prompt], return_tensors="pt")
        n = prompt["input_ids"].shape[1]
        assert row["input_ids"][:n] == prompt["input_ids"][0].tolist()
        assert torch.equal(row["pixel_values"], prompt["pixel_values"][0])
        assert row["labels"][:n] == [-100] * n
        caption = row["labels"][n:]
        assert caption[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in caption[:-1]
        assert tokenizer.decode(caption[:-1]) == image.references[1]
        assert IMAGE_TOKEN not in caption
    counts = [encoder(image, "a sign")["input_ids"].count(IMAGE_TOKEN) for image in images[:2]]
    assert counts[0] != counts[1]
    assert len(encoder.reply_ids("a red sign that says stop")) == 7
    short = CaptionEncoder(processor, max_length=3)
    assert short.reply_ids("a red sign that says stop") == encoder.reply_ids("a red sign that says stop")[:3]


def test_an_anyres_batch_of_different_sizes_scores_as_each_example_alone(tmp_path):
    """Collated rows (pixel patches padded to the batch's most) give every example the NLL it has alone."""
    from conftest import randomize_adapters
    from tiny_models import CASES, build_model, llava_next_processor

    from loramcl import MCLConfig, get_mcl_model
    from loramcl.recipes.image_captioning.prompts import CaptionEncoder, collate_captions

    processor = llava_next_processor()
    images = read_textcaps(write_textcaps(tmp_path) / "TextCaps_0.1_train.json", tmp_path / "images")
    encoder = CaptionEncoder(processor)
    rows = [encoder(image, image.references[0]) for image in images]  # 3 sizes: 5, 3 and 1 anyres patches
    assert len({r["pixel_values"].shape[0] for r in rows}) > 1
    mcl = get_mcl_model(build_model("llava_next"), MCLConfig(num_hypotheses=3, r=4, alpha=8,
                                                             target_modules=CASES["llava_next"].targets)).eval()
    randomize_adapters(mcl)
    pad = processor.tokenizer.pad_token_id
    with torch.no_grad():
        together = mcl(**collate_captions(rows, pad)).nll  # [3, K]
        alone = torch.cat([mcl(**collate_captions([r], pad)).nll for r in rows])  # [3, K]
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_quick_default_recipe_runs_end_to_end_from_an_empty_folder_and_reuses_its_stages(tmp_path, monkeypatch):
    """`loramcl image-captioning --quick true` and nothing else, in an empty folder: the packaged CPU recipe
    (image_captioning/tiny) builds a tiny random LLaVA-NeXT, writes a generated set in the TextCaps 0.1 layout and
    reads it with the official reader -> train MCL, MLE, MoE -> decode at the smallest budget (MCL beam 1 per
    hypothesis, greedy and diverse MCL decoding; MLE and MoE beam and diverse beam) -> evaluate -> report, all under
    ./runs; a second call reuses every stage."""
    from loramcl.cli import DEBUG_ENV, main
    from loramcl.recipes.image_captioning.textcaps import SYNTHETIC_WORDS, read_textcaps
    from loramcl.utils.files import read_jsonl

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DEBUG_ENV, "1")  # a failure shows its traceback
    main(["image-captioning", "--quick", "true"])
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    out = tmp_path / "runs" / "image-captioning-tiny"
    report = json.loads((out / "report.json").read_text())
    synthetic = out / "synthetic-textcaps"
    assert {p.name for p in synthetic.glob("TextCaps_0.1_*.json")} == {"TextCaps_0.1_train.json",
                                                                       "TextCaps_0.1_val.json",
                                                                       "TextCaps_0.1_test.json"}
    train = read_textcaps(synthetic / "TextCaps_0.1_train.json", synthetic / "images")
    assert len(train) == 24 and all(len(image.references) == 5 for image in train)
    assert {w for image in train for r in image.references for w in r.split()} == set(SYNTHETIC_WORDS)
    assert read_textcaps(synthetic / "TextCaps_0.1_test.json", synthetic / "images")[0].references == []
    # a quick run: the first system of each (run, strategy), so diverse beam search with the first λ
    names = {"mcl-beam-b3", "mcl-greedy-b3", "mcl-diversebeam0.8-b3", "mle-beam-b3", "mle-diversebeam0.8-b3",
             "moe-beam-b3", "moe-diversebeam0.8-b3"}
    assert set(report["systems"]) == names
    test = read_jsonl(out / "data" / "test.jsonl", "references")
    assert len(test) == 3 and all(len(r["references"]) == 5 for r in test.values())  # every reference of each image
    mcl = read_jsonl(out / "predictions" / "mcl-greedy-b3.jsonl", "candidates")
    assert list(mcl) == list(test) and all(r["hypotheses"] == [0, 1, 2] for r in mcl.values())
    for name in names:
        predictions = read_jsonl(out / "predictions" / f"{name}.jsonl", "candidates")
        assert all(len(r["candidates"]) == 3 for r in predictions.values())
        assert {"cider_d", "bleu4", "mbleu4", "div2"} <= set(report["systems"][name]["metrics"])
    assert json.loads((out / "mle" / "run.json").read_text())["train_examples"] == 40  # one per (image, reference)
    assert "CIDEr-D" in (out / "report.md").read_text() and (out / "figures" / "quality_diversity.png").is_file()
    main(["image-captioning", "--quick", "true"])
    again = json.loads((out / "report.json").read_text())
    assert set(again["timing_s"]) == {"report", "runs"}  # nothing built, trained or decoded again


def llava_v16_vicuna_7b_config():
    """LLaVA-1.6-Vicuna-7B's architecture (llava-hf/llava-v1.6-vicuna-7b-hf's config.json), written out: no file or
    weights are needed to build it."""
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                           projection_dim=768),
        text_config=dict(model_type="llama", vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                         max_position_embeddings=4096),
        image_token_index=32000, vision_feature_layer=-2,
        image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])


@pytest.mark.parametrize("recipe,runs,k,learning_rate", [("textcaps", ["mcl", "mle", "moe"], 3, 2e-4),
                                                            ("textcaps-bilingual", ["mcl", "mle"], 2, 2e-5)])
def test_paper_scale_recipe_files_load_and_build_the_model_from_a_config(tmp_path, recipe, runs, k, learning_rate):
    """The packaged image_captioning/{textcaps, textcaps-bilingual}: every file parses into its typed settings, and each
    run's method wraps LLaVA-1.6-Vicuna-7B built from its config on the meta device (no weights): adapters on
    q/k/v/up/down of the language model only, the tower and projector frozen and shared at decoding, MCL and MLE at
    equal trainable count (App. H.2, H.5)."""
    from transformers import LlavaNextForConditionalGeneration

    from loramcl.recipes.files import method_of, packaged_recipes, run_names, run_values
    from loramcl.recipes.image_captioning.reproduce import Experiment, ImageCaptioning
    from loramcl.recipes.runner import COMMON, EXPERIMENT
    from loramcl.recipes.stages import Stages
    from loramcl.training.config import TrainConfig
    from loramcl.training.fit import method_model

    folder = packaged_recipes() / "image_captioning" / recipe
    experiment = Experiment.read(folder / EXPERIMENT)
    assert (experiment.candidates, experiment.budgets, experiment.test_split) == (k, [k, 2 * k], "val")
    assert Path(experiment.textcaps).is_absolute()
    if recipe.endswith("bilingual"):
        bilingual = experiment.bilingual_settings()
        assert (bilingual.prefix, bilingual.fraction, bilingual.language) == ("translate English to French: ", 0.5,
                                                                              "fr")
        assert Path(bilingual.translator).is_absolute()
    assert run_names(folder, reserved=(EXPERIMENT, COMMON)) == runs
    values = {run: run_values(folder, run, tmp_path) for run in runs}
    training = TrainConfig(**values["mcl"]["training"])
    assert (training.learning_rate, training.scheduler, training.batch_size) == (learning_rate, "cosine", 8)
    assert training.warmup_steps == round(0.03 * training.steps) and values["mcl"]["dtype"] == "bfloat16"
    task = ImageCaptioning(folder, experiment, Stages(tmp_path / "out"), False, None, "cpu")
    assert {s.name for s in task.systems(values, [k])} >= {f"mcl-greedy-b{k}", f"mle-beam-b{k}",
                                                           f"mle-diversebeam0.8-b{k}"}
    trainable = {}
    for run in runs:
        method, config = method_of(values[run])
        with torch.device("meta"):
            model = method_model(LlavaNextForConditionalGeneration(llava_v16_vicuna_7b_config()), method, config)
        assert len(model.layer_names) == 32 * 5
        assert all(".language_model." in name and name.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj",
                                                                              "up_proj", "down_proj")
                   for name in model.layer_names)
        assert model.shared_module_names == ["model.vision_tower", "model.multi_modal_projector"]
        trainable[run] = model.parameter_counts()[0]
    assert trainable["mcl"] == trainable["mle"] == k * 8 * 32 * (3 * (4096 + 4096) + 2 * (4096 + 11008))
    if "moe" in trainable:
        assert trainable["moe"] > trainable["mcl"]  # the routers
