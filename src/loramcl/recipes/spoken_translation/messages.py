"""Spoken English UI messages whose target is either their English transcript or their French translation: an
ambiguous audio -> text task with two modes a user can see (issue 14, part 2).

The messages are the English sources of the machine's gettext catalogs that have a French translation
(``gettext_references.message_translations``). Each message is spoken to a WAV file by espeak-ng with voice settings
drawn per message from a seeded generator (voice, speed, pitch), so the audio is real synthetic speech, not text.
Training and validation examples keep ONE target, chosen at random per example (seeded): the English transcript
('en' mode) or the message's most used French translation ('fr' mode); nothing in the audio or the prompt says
which. Test examples keep both modes' references: the transcript and every distinct French translation.

Splits are by normalised English message (``gettext_pairs.normalise``), so a message and its variant with other case
or trailing punctuation never land in different splits.

For Whisper, the target follows its own format, the mode named by the target's first token: ``<|en|><|transcribe|>
<|notimestamps|> Open the file<|endoftext|>`` or ``<|fr|><|transcribe|><|notimestamps|> Ouvrir le fichier
<|endoftext|>``. The decoder is prompted with ``<|startoftranscript|>`` alone (the decoder start token), so the
model itself chooses the mode at its first step: the language token is part of what it learns and predicts, never
an input.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loramcl.data.gettext_pairs import CatalogSettings
from loramcl.utils.files import write_json
from loramcl.utils.validate import require, require_int

MODES = ("en", "fr")  # the English transcript, the French translation
ESPEAK = "espeak-ng"
ESPEAK_INSTALL = "apt-get install espeak-ng"
# espeak-ng's own English voices (the mbrola ones need another package).
VOICES = ("en-us", "en-gb", "en-gb-x-rp", "en-gb-scotland", "en-029")
# What espeak-ng reads as words: letters, spaces, apostrophes and sentence punctuation. Digits, symbols and
# abbreviations would be spoken in ways the transcript does not write.
_SPEAKABLE = re.compile(r"[A-Za-z][A-Za-z'-]*(?:,? [A-Za-z][A-Za-z'-]*)*[.!?]?")
# Whisper's task tokens after the mode's language token (no timestamps).
WHISPER_TASK_TOKENS = ("<|transcribe|>", "<|notimestamps|>")
WHISPER_LANGUAGE_TOKENS = {"en": "<|en|>", "fr": "<|fr|>"}
TRAIN_MODES = ("both", "drawn")  # the targets of a training message (``message_targets``)


@dataclass(frozen=True)
class SpokenSettings(CatalogSettings):
    """Which messages, how many per split, and how they are spoken (``seed`` also draws the mode of every example
    and the voice settings)."""

    min_chars: int = 12
    max_chars: int = 48
    train: int = 600
    """Messages per split (at most; fewer if the catalogs have fewer)."""
    validation: int = 32
    test: int = 120
    voices: tuple[str, ...] = VOICES
    speed: tuple[int, int] = (140, 185)
    """espeak-ng words per minute, drawn uniformly in this range per message."""
    pitch: tuple[int, int] = (35, 65)
    """espeak-ng pitch (0-99), drawn uniformly in this range per message."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("train", "validation", "test"):
            require_int(name, getattr(self, name), minimum=0 if name == "validation" else 1)
        require(bool(self.voices) and all(isinstance(v, str) and v for v in self.voices),
               "voices must be a non-empty list of espeak-ng voice names (espeak-ng --voices=en)")
        for name, low, high in (("speed", 80, 450), ("pitch", 0, 99)):
            bounds = getattr(self, name)
            require(len(bounds) == 2 and low <= bounds[0] <= bounds[1] <= high,
                   f"{name} must be [low, high] with {low} <= low <= high <= {high}, got {bounds!r}")
        object.__setattr__(self, "voices", tuple(self.voices))
        object.__setattr__(self, "speed", tuple(self.speed))
        object.__setattr__(self, "pitch", tuple(self.pitch))


def speakable(text: str) -> bool:
    return bool(_SPEAKABLE.fullmatch(text.strip()))


def spoken_splits(settings: SpokenSettings) -> dict[str, list[dict]]:
    """{"train", "validation", "test"}: lists of {"id", "source", "fr": [distinct French translations, most used
    first], "voice": {"voice", "speed", "pitch"}}; train and validation items add "mode" and "target", test items
    "references" (the transcript, then the French translations) and "reference_modes"."""
    from loramcl.data.gettext_pairs import normalise
    from loramcl.data.gettext_references import MultiReferenceSettings, message_translations

    messages = message_translations(MultiReferenceSettings(
        locale_dir=settings.locale_dir, target_lang="fr", min_chars=settings.min_chars, max_chars=settings.max_chars))
    groups: dict[str, list[str]] = defaultdict(list)
    for source in messages:
        if speakable(source):
            groups[normalise(source)].append(source)
    keys = sorted(groups)
    rng = random.Random(settings.seed)
    rng.shuffle(keys)
    wanted = settings.test + settings.validation + 1
    if len(keys) < wanted:
        raise ValueError(f"only {len(keys)} speakable English messages with a French translation in "
                         f"{settings.locale_dir} for {settings.test} test and {settings.validation} validation "
                         "messages: lower test/validation or widen min_chars/max_chars")
    parts = {"test": keys[:settings.test], "validation": keys[settings.test:settings.test + settings.validation],
             "train": keys[settings.test + settings.validation:][:settings.train]}
    splits: dict[str, list[dict]] = {}
    for name, part in parts.items():
        rows = []
        for key in part:
            for source in groups[key]:
                row = {"id": f"{name}-{len(rows)}", "source": source, "fr": messages[source],
                       "voice": {"voice": rng.choice(settings.voices), "speed": rng.randint(*settings.speed),
                                 "pitch": rng.randint(*settings.pitch)}}
                if name == "test":
                    row["references"] = [source, *messages[source]]
                    row["reference_modes"] = ["en"] + ["fr"] * len(messages[source])
                else:
                    row["mode"] = rng.choice(MODES)
                    row["target"] = source if row["mode"] == "en" else messages[source][0]
                rows.append(row)
        splits[name] = rows
    return splits


def message_targets(row: dict, modes: str = "both") -> list[tuple[str, str]]:
    """The (target, mode) training examples of a train or validation message: ``modes`` "drawn", its target in the
    mode drawn for it by ``spoken_splits`` (one example, the same every epoch); "both", its transcript and its most
    used French translation (two examples on the same clip, so the speech alone never tells the mode, as at test
    time)."""
    require(modes in TRAIN_MODES, f"train_modes must be one of {TRAIN_MODES}, got {modes!r}")
    return [(row["target"], row["mode"])] if modes == "drawn" else [(row["source"], "en"), (row["fr"][0], "fr")]


def espeak_path() -> str:
    """The espeak-ng program, or an error naming the Debian package that installs it."""
    found = shutil.which(ESPEAK)
    if found is None:
        raise FileNotFoundError(f"{ESPEAK} is not installed: it speaks the messages to WAV. Install the Debian package "
                                f"espeak-ng (`{ESPEAK_INSTALL}`, as root)")
    return found


def check_voices(voices) -> None:
    """Every voice is one espeak-ng knows (its language, voice name or file in `espeak-ng --voices`): espeak-ng
    itself falls back to its default voice on an unknown name, silently."""
    listing = subprocess.run([espeak_path(), "--voices"], capture_output=True, text=True, check=True).stdout
    known = {field for line in listing.splitlines()[1:] for field in line.split()[1:5]}
    unknown = [v for v in voices if v not in known]
    if unknown:
        raise ValueError(f"espeak-ng has no voice {unknown}: choose among `{ESPEAK} --voices=en` (e.g. {VOICES})")


def speak(text: str, voice: dict, folder: str | Path) -> Path:
    """``text`` spoken by espeak-ng with ``voice`` ({"voice", "speed", "pitch"}) to a WAV file in ``folder`` (22.05
    kHz mono), named by the hash of (text, voice): an existing file is reused, a new one appears whole (written
    beside, then renamed)."""
    program = espeak_path()
    key = json.dumps({"text": text, **voice}, sort_keys=True, ensure_ascii=False)
    path = Path(folder) / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.wav"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.wav")
    command = [program, "-v", str(voice["voice"]), "-s", str(voice["speed"]), "-p", str(voice["pitch"]),
               "-w", str(partial), "--", text]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{ESPEAK} failed on {text!r} with voice {voice}: "
                           f"{result.stderr.strip() or result.returncode}")
    partial.replace(path)
    return path


def write_spoken_splits(out: str | Path, settings: SpokenSettings, max_seconds: float) -> dict:
    """Speak every message of ``spoken_splits`` into <out>/audio/ and write <out>/{train,validation,test}.jsonl (each
    row with its "audio" file and "seconds") and <out>/stats.json. A message whose speech is longer than
    ``max_seconds`` (the model's audio context) is left out and counted."""
    from loramcl.data.audio_captions import audio_info

    require(max_seconds > 0, f"max_seconds must be > 0, got {max_seconds}")
    check_voices(settings.voices)  # before reading the catalogs
    out = Path(out)
    splits = spoken_splits(settings)
    stats: dict = {"settings": asdict(settings), "max_seconds": max_seconds, "splits": {}}
    for name, rows in splits.items():
        kept, too_long, seconds = [], 0, 0.0
        for row in rows:
            audio = speak(row["source"], row["voice"], out / "audio")
            rate, frames = audio_info(audio)
            if frames / rate > max_seconds:
                too_long += 1
                continue
            seconds += frames / rate
            kept.append({**row, "audio": str(audio), "seconds": round(frames / rate, 3)})
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in kept)
        modes = {mode: sum(r.get("mode") == mode for r in kept) for mode in MODES} if name != "test" else None
        stats["splits"][name] = {"messages": len(kept), "too_long": too_long, "minutes": round(seconds / 60, 2),
                                 **({"modes": modes} if modes else {}),
                                 **({"french_references_per_message": round(sum(len(r["fr"]) for r in kept)
                                                                            / max(len(kept), 1), 3)}
                                    if name == "test" else {})}
    write_json(out / "stats.json", stats)
    return stats


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a split written by ``write_spoken_splits`` (one JSON object per line)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@dataclass
class WhisperTargets:
    """Whisper's labels for a target in a mode: [<|lang|>, <|transcribe|>, <|notimestamps|>, text tokens...,
    <|endoftext|>] (the model prepends its decoder start token, <|startoftranscript|>, when it shifts the labels)."""

    tokenizer: object
    prefixes: dict = field(init=False)
    end: int = field(init=False)

    def __post_init__(self) -> None:
        def token_id(token: str) -> int:
            found = self.tokenizer.convert_tokens_to_ids(token)
            if found is None or found == self.tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no {token} token: a Whisper tokenizer is needed")
            return found

        self.prefixes = {mode: [token_id(WHISPER_LANGUAGE_TOKENS[mode]), *map(token_id, WHISPER_TASK_TOKENS)]
                         for mode in MODES}
        self.end = token_id("<|endoftext|>")

    def labels(self, target: str, mode: str) -> list[int]:
        require(mode in MODES, f"mode must be one of {MODES}, got {mode!r}")
        require(isinstance(target, str) and bool(target.strip()),
                f"a target must be a non-empty string, got {target!r}")
        text = self.tokenizer.encode(" " + target.strip(), add_special_tokens=False)
        return [*self.prefixes[mode], *text, self.end]


def collate_encoded(rows: list[dict]) -> dict:
    """A training batch of precomputed encoder states: {"encoder_outputs": ([B, positions, d],), "labels": [B, T]
    padded with -100}."""
    import torch

    length = max(len(r["labels"]) for r in rows)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        labels[i, :len(row["labels"])] = torch.tensor(row["labels"])
    return {"encoder_outputs": (torch.stack([r["encoder_states"] for r in rows]),), "labels": labels}


__all__ = ["MODES", "TRAIN_MODES", "SpokenSettings", "WhisperTargets", "check_voices", "collate_encoded",
           "message_targets", "speak", "spoken_splits", "write_spoken_splits"]
