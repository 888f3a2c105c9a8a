"""Diverse machine translation (paper §4.4, App. H.6): `loramcl translation`, on ALMA-7B at the paper's scale or on
SmolLM2-135M with a multi-reference set from the machine's gettext catalogs."""
