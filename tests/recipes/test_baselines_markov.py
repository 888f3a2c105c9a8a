"""The Markov comparison of LoRA-MCL and its baselines: its candidate statistics on hand-made candidates, and (slow)
the whole comparison in its quick form."""

import numpy as np
import pytest

from loramcl.recipes.markov.chains import preset_mixture
from loramcl.recipes.markov.compare import NEW_TOKENS, candidate_statistics


def test_candidate_statistics_assign_each_candidate_to_its_most_likely_chain():
    """fig2: chain 0 stays in state 0 (0.8), chain 1 in state 1 (0.75); a run of 0s is chain 0's, of 1s chain 1's."""
    mixture = preset_mixture("fig2")
    prompts = np.array([[0, 1, 0, 1], [1, 1, 0, 0]])
    zeros, ones = [0] * NEW_TOKENS, [1] * NEW_TOKENS
    both = candidate_statistics(mixture, prompts, [[zeros, ones], [ones, zeros]])
    assert both["distinct"] == 1.0 and both["chains_covered"] == 1.0
    same = candidate_statistics(mixture, prompts, [[zeros, zeros], [ones, zeros]])
    assert same["distinct"] == 0.5 and same["chains_covered"] == 0.5
    # log p(candidate | prompt) under the mixture: a run of 0s after a 0 is likely, alternating is not
    alternating = [t % 2 for t in range(1, NEW_TOKENS + 1)]
    assert (candidate_statistics(mixture, prompts[1:], [[zeros, zeros]])["log_prob_per_token"]
            > candidate_statistics(mixture, prompts[1:], [[alternating, alternating]])["log_prob_per_token"])


@pytest.mark.slow
def test_quick_comparison_runs_end_to_end(tmp_path):
    from loramcl.recipes.markov.compare import compare

    report = compare(out=str(tmp_path), quick=True, threads=1)
    systems = [s["system"] for s in report["summary"]]
    assert systems[:3] == ["LoRA-MLE", "LoRA-MCL", "LoRA-MoE"] and len(systems) == 6
    assert "stochastic router, greedy" in report["summary"][2]["decoding"]
    assert (tmp_path / "report.md").is_file()
