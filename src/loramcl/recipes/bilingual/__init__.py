"""The bilingual specialisation experiment (paper §4.3, App. H.5) on SmolLM2-135M: `loramcl bilingual`."""
