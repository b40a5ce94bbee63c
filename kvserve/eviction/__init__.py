"""Token eviction inside the paged cache: which tokens a sequence keeps (policy, select) and
how its slots are compacted so whole blocks return to the pool (state).

Keys are cached after RoPE, at their original positions, and never re-rotated: a kept key keeps
the distance the model saw when it was computed, and slot order stops mattering, so a hole can be
filled by any later slot, per head, without moving the rest (StreamingLLM re-rotates keys to
in-cache positions instead; kvpress, the reference for the quality runs, does not). An evicting
sequence then holds fewer slots than tokens: `StepMetadata` carries slots and positions apart.

The engine's side is engine/eviction_step.py (after each step: grow each `EvictionState`, then
`BlockManager.compact` for the sequences that are due, applied before the next schedule can hand
out the freed blocks). Blocks computed after an eviction are never registered in the prefix
cache, and an evicting sequence takes from it only what its policy never reads
(`EvictionPolicy.cacheable`). Not with offload, block-encoded formats (KIVI), a full-precision
residual, or tensor parallelism: `EngineConfig` refuses each, naming the field.
"""
