"""Audio captioning data from the official distributions of Clotho v2 and AudioCaps (paper §4.2, App. H.1), read
from a folder the user points to (nothing is downloaded), audio decoded to 16 kHz mono for the Whisper-style feature
extractor of Qwen2-Audio.

Layouts (the split names are the distributions' own):

- **Clotho v2**: ``clotho_captions_<split>.csv`` with columns ``file_name, caption_1 ... caption_5`` beside a folder
  ``<split>/`` holding the WAV files named in ``file_name``; splits ``development``, ``validation``, ``evaluation``.
- **AudioCaps**: ``<split>.csv`` with columns ``audiocap_id, youtube_id, start_time, caption`` (one row per caption:
  one per clip in train, five in val and test) beside a folder ``<split>/``; splits ``train``, ``val``, ``test``.
  A clip is a ``youtube_id``; its audio file is the first of ``<youtube_id>``, ``Y<youtube_id>`` (AudioSet's
  naming), ``<youtube_id>_<start_time>`` or ``<audiocap_id>`` (of any of its rows) with extension ``.wav`` or
  ``.flac`` that exists in ``<split>/``.

WAV is read with scipy; other formats (FLAC, OGG) with ``soundfile`` (``pip install 'loramcl[audio]'``). Several
channels are averaged; the sampling rate is converted to 16 kHz by polyphase resampling (``scipy.signal.
resample_poly``), after cropping to ``max_seconds`` (the paper: 30 s for Clotho, 10 s for AudioCaps).

Every malformed input is an error naming the file (and the CSV row: its line number, the header being line 1).
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SAMPLING_RATE = 16_000  # Whisper's and Qwen2-Audio's feature extractors
LAYOUTS = ("clotho", "audiocaps")
SPLITS = {"clotho": ("development", "validation", "evaluation"), "audiocaps": ("train", "val", "test")}
CLOTHO_COLUMNS = ("file_name", *(f"caption_{i}" for i in range(1, 6)))
AUDIOCAPS_COLUMNS = ("audiocap_id", "youtube_id", "start_time", "caption")
AUDIO_EXTENSIONS = (".wav", ".flac")
MISSING_AUDIO = ("error", "skip")
CAPTIONS_PER_CLIP = ("all", "one")
SOUNDFILE_INSTALL = "pip install 'loramcl[audio]' (the soundfile package)"


@dataclass(frozen=True)
class AudioClip:
    """One clip of a split: its id (Clotho: the file name; AudioCaps: the YouTube id), its audio file, its captions
    (1 to 5) and where it was read (``<csv>:<line>`` of its first row)."""

    id: str
    audio: str
    captions: tuple[str, ...]
    source: str


def csv_path(layout: str, root: str | Path, split: str) -> Path:
    """The captions file of ``split`` in an official ``layout`` folder."""
    _check_split(layout, split)
    return Path(root) / (f"clotho_captions_{split}.csv" if layout == "clotho" else f"{split}.csv")


def read_split(layout: str, root: str | Path, split: str, missing_audio: str = "error"
               ) -> tuple[list[AudioClip], list[str]]:
    """(clips, skipped) of one split of an official layout folder. ``missing_audio``: 'error' (default) raises on
    the first clip without an audio file; 'skip' leaves such clips out and lists them in ``skipped`` (AudioCaps
    copies often miss clips taken down from YouTube)."""
    if missing_audio not in MISSING_AUDIO:
        raise ValueError(f"missing_audio must be one of {MISSING_AUDIO}, got {missing_audio!r}")
    path = csv_path(layout, root, split)
    rows = _read_csv(path, CLOTHO_COLUMNS if layout == "clotho" else AUDIOCAPS_COLUMNS)
    folder = Path(root) / split
    clips = _clotho_clips(path, rows, folder) if layout == "clotho" else _audiocaps_clips(path, rows, folder)
    kept, skipped = [], []
    for clip, candidates in clips:
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            if missing_audio == "error":
                raise FileNotFoundError(f"{clip.source}: no audio file for clip {clip.id!r}: looked for "
                                        f"{', '.join(str(c) for c in candidates[:4])}"
                                        f"{' ...' if len(candidates) > 4 else ''} (missing_audio: skip leaves such "
                                        "clips out)")
            skipped.append(clip.id)
            continue
        kept.append(AudioClip(clip.id, str(found), clip.captions, clip.source))
    if not kept:
        raise ValueError(f"{path}: no clip of split {split!r} has an audio file in {folder}")
    return kept, skipped


def _check_split(layout: str, split: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if split not in SPLITS[layout]:
        raise ValueError(f"{layout} splits are {SPLITS[layout]}, got {split!r}")


def _read_csv(path: Path, columns: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV file with (at least) ``columns``; rows with too many or too few fields raise."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (expected the official captions file of this split)")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in columns if c not in header]
            if missing:
                raise ValueError(f"{path}: line 1 (header) lacks the column(s) {missing}; its columns are {header}, "
                                 f"the official layout has {list(columns)}")
            rows = []
            for row in reader:
                line = reader.line_num
                if None in row:
                    raise ValueError(f"{path}: line {line} has {len(header) + len(row[None])} fields, the header "
                                     f"{len(header)} (a caption holding a comma must be quoted)")
                if any(row[c] is None for c in header):
                    raise ValueError(f"{path}: line {line} has fewer fields than the header's {len(header)}")
                rows.append((line, row))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error})") from None
    except csv.Error as error:
        raise ValueError(f"{path}: malformed CSV ({error})") from None
    if not rows:
        raise ValueError(f"{path}: no rows after the header")
    return rows


def _caption(path: Path, line: int, row: dict, column: str) -> str:
    text = " ".join(row[column].split())
    if not text:
        raise ValueError(f"{path}: line {line}: empty caption in column {column!r}")
    return text


def _clotho_clips(path: Path, rows, folder: Path) -> list[tuple[AudioClip, list[Path]]]:
    clips, seen = [], {}
    for line, row in rows:
        name = row["file_name"].strip()
        if not name:
            raise ValueError(f"{path}: line {line}: empty file_name")
        if name in seen:
            raise ValueError(f"{path}: line {line}: file_name {name!r} already on line {seen[name]}")
        seen[name] = line
        captions = tuple(_caption(path, line, row, c) for c in CLOTHO_COLUMNS[1:])
        clips.append((AudioClip(name, "", captions, f"{path}:{line}"), [folder / name]))
    return clips


def _audiocaps_clips(path: Path, rows, folder: Path) -> list[tuple[AudioClip, list[Path]]]:
    grouped: dict[str, dict] = {}
    for line, row in rows:
        youtube_id, start = row["youtube_id"].strip(), row["start_time"].strip()
        audiocap_id = row["audiocap_id"].strip()
        if not youtube_id:
            raise ValueError(f"{path}: line {line}: empty youtube_id")
        if not audiocap_id.isdigit():
            raise ValueError(f"{path}: line {line}: audiocap_id must be an integer, got {audiocap_id!r}")
        try:
            start_time = float(start)
        except ValueError:
            raise ValueError(f"{path}: line {line}: start_time must be a number of seconds, got {start!r}") from None
        clip = grouped.setdefault(youtube_id, {"line": line, "start": start_time, "start_text": start, "ids": [],
                                               "captions": []})
        if clip["start"] != start_time:
            raise ValueError(f"{path}: line {line}: youtube_id {youtube_id!r} starts at {start} here and at "
                             f"{clip['start_text']} on line {clip['line']}: one audio file per YouTube id cannot "
                             "hold both")
        clip["ids"].append(audiocap_id)
        clip["captions"].append(_caption(path, line, row, "caption"))
    clips = []
    for youtube_id, clip in grouped.items():
        stems = [youtube_id, f"Y{youtube_id}", f"{youtube_id}_{clip['start_text']}", *clip["ids"]]
        candidates = [folder / f"{stem}{ext}" for stem in stems for ext in AUDIO_EXTENSIONS]
        clips.append((AudioClip(youtube_id, "", tuple(clip["captions"]), f"{path}:{clip['line']}"), candidates))
    return clips


# ---- audio ------------------------------------------------------------------------------------------------------


def audio_info(path: str | Path) -> tuple[int, int]:
    """(sampling rate, frames) of an audio file, from its header (the samples are not decoded)."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".wav":
            from scipy.io import wavfile

            rate, data = wavfile.read(path, mmap=True)
            return int(rate), int(data.shape[0])
        info = _soundfile(path).info(str(path))
        return int(info.samplerate), int(info.frames)
    except (OSError, ValueError, RuntimeError, EOFError) as error:
        raise ValueError(f"{path}: unreadable audio ({error})") from None


def load_audio(path: str | Path, sampling_rate: int = SAMPLING_RATE, max_seconds: float | None = None):
    """The audio of ``path`` as float32 mono samples in [-1, 1] at ``sampling_rate`` (numpy [n]), cropped to its
    first ``max_seconds``."""
    import numpy as np
    from scipy.signal import resample_poly

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file {path} does not exist")
    try:
        if path.suffix.lower() == ".wav":
            from scipy.io import wavfile

            rate, data = wavfile.read(path)
            data = _as_float(np.asarray(data), path)
        else:
            data, rate = _soundfile(path).read(str(path), dtype="float32", always_2d=True)
    except (OSError, ValueError, RuntimeError, EOFError) as error:
        raise ValueError(f"{path}: unreadable audio ({error})") from None
    mono = data.mean(axis=1) if data.ndim == 2 else data  # [frames]
    if max_seconds is not None:
        mono = mono[:int(math.ceil(max_seconds * rate))]
    if mono.size == 0:
        raise ValueError(f"{path}: the audio holds no samples")
    if rate != sampling_rate:
        common = math.gcd(int(rate), sampling_rate)
        mono = resample_poly(mono, sampling_rate // common, int(rate) // common)
    return np.ascontiguousarray(mono, dtype=np.float32)


def _as_float(data, path: Path):
    """WAV samples as floats in [-1, 1] (scipy gives the file's own integer type; 24-bit comes left-justified in
    int32)."""
    import numpy as np

    if data.dtype == np.uint8:
        return (data.astype(np.float32) - 128.0) / 128.0
    if data.dtype.kind == "i":
        return data.astype(np.float32) / float(np.iinfo(data.dtype).max + 1)
    if data.dtype.kind == "f":
        return data.astype(np.float32)
    raise ValueError(f"{path}: unsupported WAV sample type {data.dtype}")


def _soundfile(path: Path):
    try:
        import soundfile
    except ImportError:
        raise ImportError(f"{path}: reading {path.suffix or 'this'} audio needs soundfile: {SOUNDFILE_INSTALL}, or "
                          "convert the files to WAV") from None
    return soundfile


# ---- training and evaluation sets ------------------------------------------------------------------------------


class CaptionExamples:
    """A map-style training set of (clip, caption) examples, each encoded when read (``encode(clip, caption)``).

    captions_per_clip: 'all': one example per (clip, caption) pair (TextCaps' choice in the paper); 'one': one
    example per clip whose caption is drawn uniformly among its captions at each visit, so one caption per clip
    per epoch (the paper's choice for Clotho). The draw of the v-th visit of clip i depends on (seed, i, v) only:
    a run is reproducible, but a resumed run draws its epochs afresh from the first one.

    Examples are encoded when read (``encodes_on_read``): the trainer does not read them all up front to check
    their targets; ``encode`` refuses an example without caption tokens instead.
    """

    encodes_on_read = True

    def __init__(self, clips: Sequence[AudioClip], encode: Callable[[AudioClip, str], dict],
                 captions_per_clip: str = "all", seed: int = 0) -> None:
        if captions_per_clip not in CAPTIONS_PER_CLIP:
            raise ValueError(f"captions_per_clip must be one of {CAPTIONS_PER_CLIP}, got {captions_per_clip!r}")
        self.clips, self.encode, self.mode, self.seed = list(clips), encode, captions_per_clip, seed
        self.pairs = [(i, c) for i, clip in enumerate(self.clips) for c in range(len(clip.captions))]
        self.visits = [0] * len(self.clips)

    def __len__(self) -> int:
        return len(self.pairs) if self.mode == "all" else len(self.clips)

    def caption_index(self, i: int) -> tuple[int, int]:
        """(clip, caption) of example ``i`` (a 'one' set counts this as a visit of clip ``i``)."""
        if self.mode == "all":
            return self.pairs[i]
        visit, self.visits[i] = self.visits[i], self.visits[i] + 1
        return i, random.Random(f"{self.seed}:{i}:{visit}").randrange(len(self.clips[i].captions))

    def __getitem__(self, i: int) -> dict:
        clip, caption = self.caption_index(i)
        return self.encode(self.clips[clip], self.clips[clip].captions[caption])
