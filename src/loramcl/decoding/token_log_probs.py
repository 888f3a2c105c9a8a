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
from transformers import LogitsProcessor, StoppingCriteria

from loramcl.mcl.model import MCLModel
from loramcl.mcl.nll import token_log_probs


class ChosenTokenLogProbs(StoppingCriteria):
    """A stopping criterion (that never stops anything) which records, at every step of a generate driven by greedy
    search or sampling (one output row per input row, a row's next token drawn from that row's logits), the
    log-probability of the token each row chose under the raw logits that ``keep_logits``, a forward hook on the
    model, saw.

    ``sequence_log_probs`` sums them over each sequence's tokens, or gives None where the steps could not be told
    apart (a step without its own forward, rows that do not match: e.g. a generate that is not the plain step loop),
    so that the caller scores the candidates another way.
    """

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None  # the latest forward's last-position logits [rows, V]
        self.steps: list[torch.Tensor] = []  # [rows] per step
        self.consistent = True

    def keep_logits(self, module: nn.Module, args: tuple, output) -> None:
        logits = getattr(output, "logits", None)
        if torch.is_tensor(logits) and logits.dim() == 3 and logits.shape[1] > 0:
            self.pending = logits[:, -1]  # a view: the step's logits stay alive until its tokens are chosen

    def take_logits(self, rows: int) -> torch.Tensor | None:
        """The pending step's logits [rows, V], once; None (and the record unusable) if there are none of ``rows``."""
        logits, self.pending = self.pending, None
        if logits is None or logits.shape[0] != rows:
            self.consistent = False
            return None
        return logits

    def __call__(self, input_ids: torch.LongTensor, scores) -> torch.BoolTensor:
        logits = self.take_logits(input_ids.shape[0])
        if logits is not None and self.consistent:
            self.steps.append(token_log_probs(logits, input_ids[:, -1]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def sequence_log_probs(self, sequences: torch.Tensor, alive: torch.Tensor, per_input: int) -> torch.Tensor | None:
        """[N] sum of the log-probabilities of each sequence's generated tokens (``alive`` [N, L] marks them); None
        if they cannot be trusted. More steps than L may have run (generate may undo its last steps)."""
        rows, length = alive.shape
        if not self.consistent or len(self.steps) < length or (self.steps and self.steps[0].shape[0] != rows):
            return None
        if length == 0:
            return torch.zeros(rows, device=alive.device)
        return (torch.stack(self.steps[:length], dim=1).to(alive.device) * alive).sum(dim=1)


class BeamTokenLogProbs(ChosenTokenLogProbs, LogitsProcessor):
    """The same for beam search (``num_beams`` beams per input, rows of an input consecutive), without its beam
    indices: as a logits processor it sees the running beams [B*beams, T] of every step, as a stopping criterion
    the candidates [B*C, T+1] chosen from them. A candidate continues the running beam of its input whose tokens it
    starts with (beams with equal tokens have equal logits), so its log-probability is that beam's sum plus its
    token's; a running beam of the next step is one of those candidates. A returned sequence of L generated tokens
    is a candidate of step L - 1: matched on its tokens, it gets that candidate's sum. Only [B*C] floats and the
    candidates' token ids are kept per step; every match is checked, in one host read at the end."""

    def __init__(self, num_beams: int) -> None:
        super().__init__()
        self.num_beams = num_beams
        self.running: torch.Tensor | None = None  # this step's running beams [B*beams, T]
        self.running_sums: torch.Tensor | None = None  # [B*beams]
        self.candidates: list[torch.Tensor] = []  # per step [B*C, T+1]
        self.sums: list[torch.Tensor] = []  # per step [B*C]
        self.matched: torch.Tensor | None = None  # every match found a partner (a 0-dim bool tensor)

    def _match(self, rows: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
        """For each of ``rows`` [B*n, T], the index (0..m-1) of the first of its input's ``among`` [B*m, T] rows
        with the same tokens: [B*n]; the check that there is one is folded into ``matched``."""
        inputs = self.running.shape[0] // self.num_beams
        equal = (rows.view(inputs, -1, 1, rows.shape[1]) == among.view(inputs, 1, -1, among.shape[1])).all(-1)
        found = equal.any(-1).all()  # [B, n, m] -> every row has a partner
        self.matched = found if self.matched is None else self.matched & found
        return equal.to(torch.int8).argmax(-1).flatten()  # [B*n]

    def __call__(self, input_ids: torch.LongTensor, scores):  # no **kwargs: LogitsProcessorList would require them
        if torch.is_tensor(scores):  # called as a logits processor: the running beams of this step
            if not self.candidates:  # the first step: the prompts
                self.running_sums = torch.zeros(input_ids.shape[0], device=input_ids.device)
            elif self.consistent and input_ids.shape[1] == self.candidates[-1].shape[1]:
                inputs = input_ids.shape[0] // self.num_beams
                kept = self.candidates[-1].shape[0] // inputs
                chosen = self._match(input_ids, self.candidates[-1])  # [B*beams] in 0..C-1
                offsets = torch.arange(inputs, device=chosen.device).repeat_interleave(self.num_beams) * kept
                self.running_sums = self.sums[-1][chosen + offsets]
            else:
                self.consistent = False
            self.running = input_ids
            return scores
        # called as a stopping criterion: the candidates of this step
        logits = self.take_logits(self.running.shape[0] if self.running is not None else -1)
        if logits is not None and self.consistent and input_ids.shape[1] == self.running.shape[1] + 1:
            inputs = self.running.shape[0] // self.num_beams
            source = self._match(input_ids[:, :-1], self.running)  # [B*C] beam of its input
            per_input = input_ids.shape[0] // inputs
            rows = source + torch.arange(inputs, device=source.device).repeat_interleave(per_input) * self.num_beams
            self.candidates.append(input_ids)
            self.sums.append(self.running_sums[rows] + token_log_probs(logits, input_ids[:, -1], rows))
        else:
            self.consistent = False
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def sequence_log_probs(self, sequences: torch.Tensor, alive: torch.Tensor, per_input: int) -> torch.Tensor | None:
        rows, length = alive.shape
        generated = alive.sum(dim=1)  # [N] tokens of each sequence, eos included
        if not self.consistent or len(self.candidates) < length or rows % per_input:
            return None
        prompt = sequences.shape[1] - length
        inputs = rows // per_input
        result = torch.zeros(rows, device=alive.device)
        for t in range(length):  # the sequences of t + 1 tokens are candidates of step t
            candidates = self.candidates[t]  # [B*C, P+t+1]
            if candidates.shape[1] != prompt + t + 1 or candidates.shape[0] % inputs:
                return None
            kept = candidates.shape[0] // inputs
            ends_here = generated == t + 1  # [N]
            tokens = sequences[:, :prompt + t + 1].to(candidates.device)
            equal = (tokens.view(inputs, per_input, 1, -1) == candidates.view(inputs, 1, kept, -1)).all(-1)  # [B,R,C]
            found = equal.any(-1).flatten() | ~ends_here  # [N]
            self.matched = found.all() if self.matched is None else self.matched & found.all()
            index = equal.to(torch.int8).argmax(-1) + torch.arange(inputs, device=equal.device)[:, None] * kept
            result = torch.where(ends_here, self.sums[t][index.flatten()], result)
        if self.matched is not None and not bool(self.matched):  # the one host read
            return None
        return result


def generating_module(model: nn.Module) -> nn.Module:
    """The transformers model whose forward generate calls at every step (inside an MCL or PEFT wrapper)."""
    module = model.base_model if isinstance(model, MCLModel) else model
    return module.get_base_model() if hasattr(module, "get_base_model") else module
