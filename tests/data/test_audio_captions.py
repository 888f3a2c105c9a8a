"""Readers of the official Clotho v2 and AudioCaps layouts, audio decoding to 16 kHz mono, training sets."""

import csv

import numpy as np
import pytest
from scipy.io import wavfile

from loramcl.data.audio_captions import CaptionExamples, audio_info, load_audio, read_split


def tone(frequency: float, seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.5 * np.sin(2 * np.pi * frequency * t)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def write_csv(path, header, rows):
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


CLOTHO_HEADER = ["file_name", "caption_1", "caption_2", "caption_3", "caption_4", "caption_5"]


@pytest.fixture
def clotho(tmp_path):
    """Clotho v2 as distributed: clotho_captions_<split>.csv beside <split>/ of 44.1 kHz WAV (16-bit stereo)."""
    for split, names in [("development", ["a dog.wav", "rain, on roof.wav"]), ("validation", ["v1.wav"]),
                         ("evaluation", ["e1.wav"])]:
        (tmp_path / split).mkdir()
        rows = []
        for n, name in enumerate(names):
            wave = tone(440.0 * (n + 1), 0.5, 44_100, channels=2)
            wavfile.write(tmp_path / split / name, 44_100, (wave * 32767).astype(np.int16))
            rows.append([name] + [f"{split} clip {n} caption {c}, with a comma" for c in range(1, 6)])
        write_csv(tmp_path / f"clotho_captions_{split}.csv", CLOTHO_HEADER, rows)
    return tmp_path


def test_clotho_layout_parsed_exactly(clotho):
    clips, skipped = read_split("clotho", clotho, "development")
    assert skipped == [] and [c.id for c in clips] == ["a dog.wav", "rain, on roof.wav"]
    assert clips[1].captions == tuple(f"development clip 1 caption {c}, with a comma" for c in range(1, 6))
    assert clips[1].audio == str(clotho / "development" / "rain, on roof.wav")
    assert clips[0].source.endswith("clotho_captions_development.csv:2")
    for split in ("validation", "evaluation"):
        assert [c.id for c in read_split("clotho", clotho, split)[0]] == [f"{split[0]}1.wav"]
    with pytest.raises(ValueError, match="clotho splits are"):
        read_split("clotho", clotho, "train")


def test_audio_decoded_to_16khz_mono_with_its_frequency(clotho):
    path = clotho / "development" / "rain, on roof.wav"  # an 880 Hz stereo tone at 44.1 kHz
    assert audio_info(path) == (44_100, 22_050)
    samples = load_audio(path)
    assert samples.dtype == np.float32 and samples.shape == (8000,)
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * 16_000 / len(samples) - 880.0) < 4.0
    assert abs(np.abs(samples).max() - 0.5) < 0.02  # int16 scaled to [-1, 1], channels averaged
    assert load_audio(path, max_seconds=0.25).shape == (4000,)


def test_audio_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.wav"):
        load_audio(tmp_path / "gone.wav")
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"this is not a RIFF file at all")
    with pytest.raises(ValueError, match="bad.wav: unreadable audio"):
        load_audio(bad)
    with pytest.raises(ValueError, match="bad.wav: unreadable audio"):
        audio_info(bad)
    empty = tmp_path / "empty.wav"
    wavfile.write(empty, 16_000, np.zeros(0, dtype=np.int16))
    with pytest.raises(ValueError, match="empty.wav: the audio holds no samples"):
        load_audio(empty)


def test_clotho_errors_name_file_and_row(clotho):
    path = clotho / "clotho_captions_validation.csv"
    write_csv(path, CLOTHO_HEADER, [["v1.wav", "a", "b", "", "d", "e"]])
    with pytest.raises(ValueError, match=r"validation.csv: line 2: empty caption in column .caption_3."):
        read_split("clotho", clotho, "validation")
    write_csv(path, CLOTHO_HEADER[:-1], [["v1.wav", "a", "b", "c", "d"]])
    with pytest.raises(ValueError, match=r"line 1 \(header\) lacks the column\(s\) \['caption_5'\]"):
        read_split("clotho", clotho, "validation")
    path.write_text(",".join(CLOTHO_HEADER) + "\nv1.wav,a,b,c,d,e\nv1.wav,a,b,c,d,e,f\n")
    with pytest.raises(ValueError, match="line 3 has 7 fields, the header 6"):
        read_split("clotho", clotho, "validation")
    write_csv(path, CLOTHO_HEADER, [["v1.wav", *"abcde"], ["v2.wav", *"abcde"]])
    with pytest.raises(FileNotFoundError, match=r"clotho_captions_validation.csv:3: no audio file for clip 'v2.wav'"):
        read_split("clotho", clotho, "validation")
    clips, skipped = read_split("clotho", clotho, "validation", missing_audio="skip")
    assert [c.id for c in clips] == ["v1.wav"] and skipped == ["v2.wav"]


AUDIOCAPS_HEADER = ["audiocap_id", "youtube_id", "start_time", "caption"]


@pytest.fixture
def audiocaps(tmp_path):
    """AudioCaps: {train,val,test}.csv (one row per caption) beside <split>/ of 32 kHz WAV named by YouTube id
    (train), by AudioSet's Y<id> (val) and by <id>_<start> (test)."""
    layout = {"train": [("101", "yt-A", "30", "a cat meows"), ("102", "yt_B", "0", "wind blows")],
              "val": [(str(200 + i), "yt-C", "10", f"engine idles {i}") for i in range(5)],
              "test": [(str(300 + i), "yt-D", "20", f"birds sing {i}") for i in range(5)]}
    names = {"train": "{y}.wav", "val": "Y{y}.wav", "test": "{y}_{s}.wav"}
    for split, rows in layout.items():
        (tmp_path / split).mkdir()
        write_csv(tmp_path / f"{split}.csv", AUDIOCAPS_HEADER, rows)
        for _, youtube_id, start, _ in rows:
            name = names[split].format(y=youtube_id, s=start)
            wavfile.write(tmp_path / split / name, 32_000, tone(300.0, 0.25, 32_000).astype(np.float32))
    return tmp_path


def test_audiocaps_layout_groups_captions_per_clip(audiocaps):
    train, _ = read_split("audiocaps", audiocaps, "train")
    assert [(c.id, c.captions) for c in train] == [("yt-A", ("a cat meows",)), ("yt_B", ("wind blows",))]
    val, _ = read_split("audiocaps", audiocaps, "val")
    assert len(val) == 1 and val[0].captions == tuple(f"engine idles {i}" for i in range(5))
    assert val[0].audio.endswith("Yyt-C.wav")
    test, _ = read_split("audiocaps", audiocaps, "test")
    assert test[0].audio.endswith("yt-D_20.wav") and len(test[0].captions) == 5
    assert load_audio(test[0].audio).shape == (4000,)  # 0.25 s at 32 kHz -> 16 kHz


def test_audiocaps_errors_name_file_and_row(audiocaps):
    path = audiocaps / "val.csv"
    write_csv(path, AUDIOCAPS_HEADER, [("200", "yt-C", "10", "x"), ("201", "yt-C", "12", "y")])
    with pytest.raises(ValueError, match=r"val.csv: line 3: youtube_id 'yt-C' starts at 12 here and at 10 on line 2"):
        read_split("audiocaps", audiocaps, "val")
    write_csv(path, AUDIOCAPS_HEADER, [("200", "yt-C", "ten", "x")])
    with pytest.raises(ValueError, match="val.csv: line 2: start_time must be a number"):
        read_split("audiocaps", audiocaps, "val")
    write_csv(path, AUDIOCAPS_HEADER, [("200", "yt-C", "10", "  ")])
    with pytest.raises(ValueError, match="val.csv: line 2: empty caption in column 'caption'"):
        read_split("audiocaps", audiocaps, "val")
    write_csv(path, AUDIOCAPS_HEADER, [("200", "yt-Z", "10", "a")])
    with pytest.raises(FileNotFoundError, match=r"val.csv:2: no audio file for clip 'yt-Z'.*yt-Z.wav"):
        read_split("audiocaps", audiocaps, "val")


def test_flac_through_soundfile(tmp_path):
    soundfile = pytest.importorskip("soundfile")
    path = tmp_path / "clip.flac"
    soundfile.write(path, tone(500.0, 0.5, 48_000), 48_000)
    samples = load_audio(path)
    assert samples.shape == (8000,)
    assert abs(np.argmax(np.abs(np.fft.rfft(samples))) * 2.0 - 500.0) < 4.0  # 0.5 s: bins of 2 Hz
    assert audio_info(path) == (48_000, 24_000)


def test_training_sets_all_pairs_or_one_caption_per_clip_per_epoch(clotho):
    clips, _ = read_split("clotho", clotho, "development")
    every = CaptionExamples(clips, lambda clip, caption: (clip.id, caption), "all")
    assert len(every) == 10 and [every[i] for i in range(10)] == [(c.id, t) for c in clips for t in c.captions]
    one = CaptionExamples(clips, lambda clip, caption: (clip.id, caption), "one", seed=3)
    assert len(one) == 2
    epochs = [[one[i] for i in range(2)] for _ in range(20)]
    assert all(e[i][0] == clips[i].id and e[i][1] in clips[i].captions for e in epochs for i in range(2))
    assert len({e[0][1] for e in epochs}) > 2  # a new draw at each epoch
    again = CaptionExamples(clips, lambda clip, caption: (clip.id, caption), "one", seed=3)
    assert [[again[i] for i in range(2)] for _ in range(20)] == epochs  # reproducible
    with pytest.raises(ValueError, match="captions_per_clip must be one of"):
        CaptionExamples(clips, lambda clip, caption: None, "some")
