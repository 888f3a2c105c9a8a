"""Readers and prompts more than one task uses: ``prompts`` (prompt -> target pairs, their tokens and labels),
``gettext_pairs`` and ``gettext_references`` (the machine's gettext catalogs as translation pairs and multi-reference
sets), ``audio_captions`` (audio-caption datasets' files and their audio). A reader only one task uses lives in that
task's folder under ``loramcl.recipes``."""
