"""SpecAugment time and frequency masking (Park et al. 2019, "SpecAugment: A Simple Data Augmentation Method for
Automatic Speech Recognition", Interspeech) of audio features, for test-time augmentation: K masked copies of the
input features give K perturbed contexts.

A frequency mask sets channels [f0, f0 + f) to the mask value, f ~ U{0..F}, f0 ~ U{0..n_mels - f}; a time mask does
the same to frames [t0, t0 + t), t ~ U{0..T} capped at p * frames. Every example draws its own masks; masks may
overlap. Time warping, the paper's third operation, is left out (its discussion finds it the most expensive and the
least influential of the three).

The defaults are the paper's LibriSpeech policy with two masks of each kind (Table 1, "LD"; the basic "LB" policy is
the same with one mask of each kind): F = 27, mF = 2, T = 100, p = 1.0, mT = 2. They are meant for features at a
10 ms hop (80 log-mel channels in the paper; Whisper and Qwen2-Audio use 80 or 128 channels at 10 ms).

Pure torch: torchaudio is not needed (its ``FrequencyMasking``/``TimeMasking`` draw the same kind of masks).
"""

from __future__ import annotations

import torch
from torch import Tensor

# SpecAugment LibriSpeech "LD" policy (Park et al. 2019, Table 1).
FREQ_MASK_WIDTH = 27  # F
TIME_MASK_WIDTH = 100  # T
NUM_MASKS = 2  # mF = mT
MAX_TIME_RATIO = 1.0  # p


def spec_augment(features: Tensor, *, num_time_masks: int = NUM_MASKS, max_time_width: int = TIME_MASK_WIDTH,
                 num_freq_masks: int = NUM_MASKS, max_freq_width: int = FREQ_MASK_WIDTH,
                 max_time_ratio: float = MAX_TIME_RATIO, generator: torch.Generator | None = None,
                 mask_value: float | None = None, lengths: Tensor | None = None) -> Tensor:
    """A masked copy of ``features`` [B, n_mels, frames] or [n_mels, frames]; ``features`` is left untouched.

    num_time_masks, max_time_width: mT time masks per example, each t ~ U{0..T} frames wide.
    num_freq_masks, max_freq_width: mF frequency masks per example, each f ~ U{0..F} channels wide.
    max_time_ratio: p, the upper bound on a time mask's width as a fraction of the frames (of ``lengths`` if given).
    generator: a CPU ``torch.Generator`` for reproducible masks (the masks are drawn on the CPU whatever the device).
    mask_value: what masked cells are set to; None uses each example's mean feature value (the paper masks with zero
        after normalising features to zero mean; the mean does the same for features that are not, e.g. Whisper's).
    lengths: [B] valid frames per example (e.g. ``feature_attention_mask.sum(-1)``), so that time masks fall on
        audio rather than on padding; None means all frames.
    """
    if features.dim() not in (2, 3):
        raise ValueError(f"features must be [B, n_mels, frames] or [n_mels, frames], got shape {tuple(features.shape)}")
    for name, value in (("num_time_masks", num_time_masks), ("max_time_width", max_time_width),
                        ("num_freq_masks", num_freq_masks), ("max_freq_width", max_freq_width)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not 0.0 < max_time_ratio <= 1.0:
        raise ValueError(f"max_time_ratio (p) must be in (0, 1], got {max_time_ratio}")
    batched = features if features.dim() == 3 else features.unsqueeze(0)  # [B, n_mels, frames]
    batch, n_mels, frames = batched.shape
    if lengths is None:
        lengths = torch.full((batch,), frames)
    lengths = torch.as_tensor(lengths).cpu().long().clamp(0, frames).reshape(-1)  # [B]
    if lengths.numel() != batch:
        raise ValueError(f"lengths must give the valid frames of each of the {batch} examples, got {lengths.numel()}")

    channel_limit = torch.full((batch,), n_mels)  # [B]
    time_limit = torch.minimum(lengths, (max_time_ratio * lengths).floor().long())  # [B] widest time mask allowed
    freq_bands = _draw_bands(num_freq_masks, max_freq_width, channel_limit, channel_limit, generator)  # [B, n_mels]
    time_bands = _draw_bands(num_time_masks, max_time_width, time_limit, lengths, generator, size=frames)  # [B, T]
    mask = (freq_bands[:, :, None] | time_bands[:, None, :]).to(batched.device)  # [B, n_mels, frames]
    if mask_value is None:
        fill = batched.mean(dim=(1, 2), keepdim=True)  # [B, 1, 1]
    else:
        fill = torch.tensor(mask_value, dtype=batched.dtype, device=batched.device)
    masked = torch.where(mask, fill.to(batched.dtype), batched)
    return masked if features.dim() == 3 else masked.squeeze(0)


def _draw_bands(count: int, max_width: int, width_limit: Tensor, span: Tensor, generator: torch.Generator | None,
                size: int | None = None) -> Tensor:
    """``count`` random bands per example: width w ~ U{0..max_width} capped at width_limit[b], start ~ U{0..span[b]
    - w}; returns [B, size] True inside any band (size defaults to max(span))."""
    batch = span.shape[0]
    size = int(span.max()) if size is None else size
    if count == 0 or max_width == 0:
        return torch.zeros(batch, size, dtype=torch.bool)
    widths = torch.randint(0, max_width + 1, (batch, count), generator=generator)  # [B, count]
    widths = torch.minimum(widths, width_limit[:, None])
    room = (span[:, None] - widths + 1).clamp(min=1)  # [B, count] possible starts
    starts = (torch.rand(batch, count, generator=generator) * room).floor().long()  # [B, count]
    position = torch.arange(size)[None, None, :]  # [1, 1, size]
    inside = (position >= starts[..., None]) & (position < (starts + widths)[..., None])  # [B, count, size]
    return inside.any(dim=1)


def tta_augment(time_fraction: float, frequency_fraction: float, lengths=None):
    """SpecAugment at strength φ = (time, frequency): one time mask of width U{0..time x frames of audio} (capped
    at that fraction of each clip's own frames) and one frequency mask of width U{0..frequency x mel channels}, drawn
    afresh for each candidate (``generate_hypotheses`` seeds them). lengths: [B] frames of audio of each clip of the
    batch, for inputs without a ``feature_attention_mask`` (Whisper's); None: from that mask."""
    given = lengths

    def augment(inputs: dict, k: int) -> dict:
        features = inputs["input_features"]  # [B, n_mels, frames]
        lengths = inputs["feature_attention_mask"].sum(-1) if given is None else given  # [B] audio, not padding
        masked = spec_augment(features, num_time_masks=1, max_time_width=int(time_fraction * int(lengths.max())),
                              max_time_ratio=max(time_fraction, 1e-6), num_freq_masks=1,
                              max_freq_width=int(frequency_fraction * features.shape[1]), lengths=lengths)
        return {**inputs, "input_features": masked}

    return augment
