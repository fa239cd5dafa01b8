//! How TP ranks share replicated KV: the Collective trait, the plan gate, rank-0 layer broadcast, split read and all-gather, mode choice.
