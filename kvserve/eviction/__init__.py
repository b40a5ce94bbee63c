"""Token eviction inside the paged cache: which tokens a sequence keeps (policy, select) and
how its slots are compacted so whole blocks return to the pool (state)."""
