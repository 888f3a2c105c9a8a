"""The data users bring and the readers more than one task uses: ``formats`` (``prepare_dataset``: TRL's text /
messages / prompt-completion rows and multi-reference rows -> input_ids and labels with the tokenizer's own chat
template), ``sources`` (``read_dataset``: a local JSONL, JSON, Parquet, CSV, Arrow file or ``save_to_disk`` folder),
``prompts`` (prompt -> target pairs, their tokens and labels), ``gettext_pairs`` and ``gettext_references`` (the
machine's gettext catalogs as translation pairs and multi-reference sets), ``audio_captions`` (audio-caption
datasets' files and their audio). A reader only one task uses lives in that task's folder under ``loramcl.recipes``."""

from loramcl.data.formats import prepare_dataset

__all__ = ["prepare_dataset"]
