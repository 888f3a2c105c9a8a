"""The log-probabilities of the chosen tokens only, under the model's raw logits, without keeping the vocabulary.

transformers' ``output_logits=True`` keeps an fp32 ``[rows, V]`` copy of every step's logits until generate returns
(a 49k-vocabulary model at 80 rows: 15 MB a step), and reading them back afterwards costs a second pass over all of
them, from memory long gone cold. ``ChosenTokenLogProbs`` reads each step's logits once, while they are the step's
own: a forward hook on the model keeps a reference to the last position's logits, and generate calls the stopping
criterion once per step right after choosing the tokens (``input_ids`` then ends with them), where the chosen
token's log-softmax is taken and only ``[rows]`` floats are kept.

``loramcl.mcl.nll.token_log_probs`` is the one computation, in blocks of rows, so that its fp32 temporary stays small
whatever the rows (a teacher-forced re-scoring has rows x positions of them).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import StoppingCriteria

from loramcl.mcl.nll import token_log_probs


class ChosenTokenLogProbs(StoppingCriteria):
    """Within ``recording(module)``, a stopping criterion (that never stops anything) which records, at every step
    of a generate driven by greedy search or sampling (one output row per input row, a row's next token drawn from
    that row's logits), the log-probability of the token each row chose under ``module``'s raw logits.

    ``log_probs(length)`` gives them as [rows, length] (the first ``length`` steps), or None where the steps could
    not be told apart (a step without its own forward, rows that do not match: e.g. a generate that is not the
    plain step loop), so that the caller scores the candidates another way.
    """

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None  # the latest forward's last-position logits [rows, V]
        self.steps: list[torch.Tensor] = []  # [rows] per step
        self.consistent = True

    def keep_logits(self, module: nn.Module, args: tuple, output) -> None:
        logits = getattr(output, "logits", None)
        if torch.is_tensor(logits) and logits.dim() == 3 and logits.shape[1] > 0:
            self.pending = logits[:, -1]  # a view: the step's logits stay alive until its tokens are chosen

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        logits, self.pending = self.pending, None
        if logits is None or logits.shape[0] != input_ids.shape[0]:
            self.consistent = False
        elif self.consistent:
            self.steps.append(token_log_probs(logits, input_ids[:, -1]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def log_probs(self, rows: int, length: int) -> torch.Tensor | None:
        """[rows, length] log-probabilities of the generated tokens, step by step; None if they cannot be trusted.
        More steps than ``length`` may have run (generate may undo its last steps); fewer mean a mismatch."""
        if not self.consistent or len(self.steps) < length or (self.steps and self.steps[0].shape[0] != rows):
            return None
        if length == 0:
            return torch.zeros(rows, 0)
        return torch.stack(self.steps[:length], dim=1)


def generating_module(model: nn.Module) -> nn.Module:
    """The transformers model whose forward generate calls at every step (inside an MCL or PEFT wrapper)."""
    from loramcl.mcl.model import MCLModel

    module = model.base_model if isinstance(model, MCLModel) else model
    return module.get_base_model() if hasattr(module, "get_base_model") else module
