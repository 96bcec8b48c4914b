"""AutoCache: sample keys, validity, the activation store, boundary advance, embedding skip, the cached stack."""
