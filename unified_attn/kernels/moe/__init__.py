"""Routed experts: `grouped_experts` (the products) and `expert_blocks` (the pair sort)."""
