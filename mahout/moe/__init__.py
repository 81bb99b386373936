"""Load-adaptive MoE expert sharding on the host side: expert workers that hold a
(layer, expert-range) slice, and a coordinator that dispatches routed experts to them
when its own inference slots are busy (see `mahout.moe.policy`)."""
