"""`loramcl audio-captioning`: audio captioning with Qwen2-Audio (paper §4.2, App. H.1)."""
