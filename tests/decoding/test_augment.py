"""SpecAugment masking: bounds, widths, reproducibility, and that the input is left untouched."""

import inspect
import sys

import pytest
import torch

from loramcl.decoding.augment import spec_augment

MASK = -1e4  # a value randn features never take, so masked cells can be told apart


def features(batch=4, n_mels=80, frames=300, seed=0):
    return torch.randn(batch, n_mels, frames, generator=torch.Generator().manual_seed(seed))


def bands(flags: torch.Tensor) -> list[tuple[int, int]]:
    """Runs of True in a 1-D bool tensor, as (start, width)."""
    runs, start = [], None
    for i, flag in enumerate([*flags.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def masked_rows_and_frames(out: torch.Tensor):
    """For one example [n_mels, frames]: the fully masked channels and frames, checking nothing else is masked."""
    masked = out == MASK
    channels, frames = masked.all(dim=1), masked.all(dim=0)
    assert torch.equal(masked, channels[:, None] | frames[None, :]), "masks must cover whole channels or frames"
    return channels, frames


def test_defaults_are_the_paper_ld_policy():
    params = inspect.signature(spec_augment).parameters
    assert params["max_freq_width"].default == 27 and params["num_freq_masks"].default == 2
    assert params["max_time_width"].default == 100 and params["num_time_masks"].default == 2
    assert params["max_time_ratio"].default == 1.0


def test_input_untouched_and_shape_kept():
    x = features()
    before = x.clone()
    out = spec_augment(x, generator=torch.Generator().manual_seed(1))
    assert torch.equal(x, before)
    assert out.shape == x.shape and out.dtype == x.dtype and out.data_ptr() != x.data_ptr()
    assert not torch.equal(out, x)


def test_masks_are_whole_bands_within_bounds():
    g = torch.Generator().manual_seed(2)
    widest_freq = widest_time = 0
    for _ in range(50):
        out = spec_augment(features(batch=2, n_mels=40, frames=120), num_freq_masks=1, max_freq_width=9,
                           num_time_masks=1, max_time_width=30, generator=g, mask_value=MASK)
        for example in out:
            channels, frames = masked_rows_and_frames(example)
            freq, time = bands(channels), bands(frames)
            assert len(freq) <= 1 and len(time) <= 1
            for start, width in freq:
                assert 0 <= start and start + width <= 40 and width <= 9
                widest_freq = max(widest_freq, width)
            for start, width in time:
                assert 0 <= start and start + width <= 120 and width <= 30
                widest_time = max(widest_time, width)
    assert widest_freq >= 7 and widest_time >= 25  # the draws reach the upper bounds, not just small widths


def test_several_masks_and_time_ratio():
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        out = spec_augment(features(batch=3, n_mels=64, frames=100), num_freq_masks=3, max_freq_width=5,
                           num_time_masks=2, max_time_width=80, max_time_ratio=0.2, generator=g, mask_value=MASK)
        for example in out:
            channels, frames = masked_rows_and_frames(example)
            assert len(bands(channels)) <= 3 and int(channels.sum()) <= 3 * 5
            assert len(bands(frames)) <= 2 and all(width <= 2 * 20 for _, width in bands(frames))
            assert int(frames.sum()) <= 2 * 20  # p = 0.2 caps each time mask at 20 of the 100 frames


def test_time_masks_stay_within_lengths():
    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([50, 200, 0])
    for _ in range(20):
        out = spec_augment(features(batch=3, frames=200), num_freq_masks=0, max_time_width=40, generator=g,
                           mask_value=MASK, lengths=lengths)
        for example, length in zip(out, lengths.tolist(), strict=True):
            _, frames = masked_rows_and_frames(example)
            assert not frames[length:].any()


def test_reproducible_with_a_generator_and_independent_per_example():
    x = features(batch=8)
    first = spec_augment(x, generator=torch.Generator().manual_seed(5))
    again = spec_augment(x, generator=torch.Generator().manual_seed(5))
    other = spec_augment(x, generator=torch.Generator().manual_seed(6))
    assert torch.equal(first, again) and not torch.equal(first, other)
    masks = (spec_augment(x, generator=torch.Generator().manual_seed(5), mask_value=MASK) == MASK)
    assert any(not torch.equal(masks[0], masks[i]) for i in range(1, 8))


def test_unbatched_input_and_default_mask_value():
    x = features(batch=1)[0] + 3.0  # [n_mels, frames], mean far from zero
    out = spec_augment(x, generator=torch.Generator().manual_seed(7))
    assert out.shape == x.shape
    masked = out != x
    assert masked.any()
    assert torch.allclose(out[masked], x.mean().expand(int(masked.sum())))  # default: the example's mean


def test_no_masks_gives_an_equal_copy():
    x = features()
    out = spec_augment(x, num_time_masks=0, num_freq_masks=0)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("kwargs", [dict(num_time_masks=-1), dict(max_freq_width=2.5), dict(max_time_ratio=0.0),
                                    dict(lengths=torch.tensor([10, 20]))])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        spec_augment(features(batch=3), **kwargs)
    with pytest.raises(ValueError, match="shape"):
        spec_augment(torch.zeros(2, 3, 4, 5))


def test_does_not_need_torchaudio():
    assert "torchaudio" not in inspect.getsource(sys.modules[spec_augment.__module__]).split('"""', 2)[2]
