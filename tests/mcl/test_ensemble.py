"""assemble_hypotheses: independently trained runs stacked into one K-hypothesis model, each hypothesis computing
exactly what its member computes alone; members that do not fit together are refused."""

import copy

import pytest
import torch
from conftest import randomize_adapters
from tiny_models import build_model

from loramcl import MCLConfig, assemble_hypotheses, get_mcl_model, load_mcl_model
from loramcl.decoding import generate_hypotheses

TARGETS = ["q_proj", "v_proj"]
PROMPTS = {"input_ids": torch.tensor([[5, 20, 7, 9], [6, 21, 8, 3]]), "attention_mask": torch.ones(2, 4, dtype=int)}


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """A plain base and two K = 1 members on it (different random adapters, as two seeds would give)."""
    root = tmp_path_factory.mktemp("ensemble")
    torch.manual_seed(0)
    base = build_model("llama").eval()
    for seed in (0, 1):
        member = get_mcl_model(copy.deepcopy(base), MCLConfig(num_hypotheses=1, r=4, alpha=8, target_modules=TARGETS))
        randomize_adapters(member, std=0.5, seed=seed)
        member.save_pretrained(root / f"mle-seed{seed}")
    return base, [root / "mle-seed0", root / "mle-seed1"]


def test_hypothesis_k_decodes_exactly_as_member_k_alone(members, tmp_path):
    base, folders = members
    assembled = assemble_hypotheses(copy.deepcopy(base), folders)
    assembled.save_pretrained(tmp_path / "ensemble")  # one K = 2 folder, as every stage reads it
    model = load_mcl_model(copy.deepcopy(base), tmp_path / "ensemble")
    assert model.num_hypotheses == 2 and model.mcl_config.r == 4
    settings = dict(strategy="greedy", max_new_tokens=6, pad_token_id=0)
    with torch.no_grad():
        logits = model(**PROMPTS).logits  # [B, K, T, V]
        outs = generate_hypotheses(model, None, PROMPTS, **settings)
        for k, folder in enumerate(folders):
            member = load_mcl_model(copy.deepcopy(base), folder)
            torch.testing.assert_close(logits[:, k], member(**PROMPTS).logits[:, 0], rtol=0, atol=1e-6)
            alone = generate_hypotheses(member, None, PROMPTS, num_sequences=1, **settings)
            assert [out[k].token_ids for out in outs] == [out[0].token_ids for out in alone]
    assert not torch.equal(logits[:, 0], logits[:, 1])  # the members differ: the equalities above have a subject


def test_members_that_do_not_fit_together_are_refused(members, tmp_path):
    base, folders = members
    other = get_mcl_model(copy.deepcopy(base), MCLConfig(num_hypotheses=1, r=4, alpha=16, target_modules=TARGETS))
    other.save_pretrained(tmp_path / "alpha16")
    with pytest.raises(ValueError, match=r"alpha16 differs from .*mle-seed0 in alpha: the members of one model"):
        assemble_hypotheses(copy.deepcopy(base), [folders[0], tmp_path / "alpha16"])
    scored = get_mcl_model(copy.deepcopy(base), MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=TARGETS,
                                                          scoring=True))
    scored.save_pretrained(tmp_path / "scored")
    with pytest.raises(ValueError, match="scored has hypothesis scores"):
        assemble_hypotheses(copy.deepcopy(base), [folders[0], tmp_path / "scored"])
    with pytest.raises(ValueError, match="two or more trained runs"):
        assemble_hypotheses(copy.deepcopy(base), folders[:1])
    with pytest.raises(ValueError, match="already has MCL adapters"):
        assemble_hypotheses(get_mcl_model(copy.deepcopy(base), MCLConfig(target_modules=TARGETS)), folders)


def test_a_member_named_twice_or_holding_anothers_adapters_is_refused(members, tmp_path):
    """Issue 61: as the recipe runner refuses an ensemble listing a run twice, so does assemble_hypotheses, also for two
    folders holding the same adapters (two identical hypotheses)."""
    import shutil

    base, folders = members
    with pytest.raises(ValueError, match=r"assemble_hypotheses: .*mle-seed0 is named twice \(as .*mle-seed0\): each "
                                         "member is a distinct run, named once"):
        assemble_hypotheses(copy.deepcopy(base), [folders[0], folders[1], folders[0]])
    shutil.copytree(folders[0], tmp_path / "copy")
    with pytest.raises(ValueError, match=r"assemble_hypotheses: .*copy holds the same adapters as .*mle-seed0 \(the "
                                         "same weights file, byte for byte\): two identical hypotheses"):
        assemble_hypotheses(copy.deepcopy(base), [folders[0], tmp_path / "copy"])
