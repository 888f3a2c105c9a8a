"""Image captioning with reading comprehension: `loramcl image-captioning` (paper §4.3, App. H.2-H.4)."""
