"""ZeRO-3 keeps parameters sharded: at most one layer is gathered at a time."""
from ranks import run_ranks
from training import zero3_memory_worker


# At a layer boundary the next layer's first gather may be issued while a small
# parameter of the previous one (a layer-norm weight its backward still reads)
# is alive: "one layer" is measured with that much slack.
LAYER_SLACK = 1.1


def test_zero3_peak_parameter_bytes_is_a_shard_plus_one_layer():
    world = 2
    for rank, m in enumerate(run_ranks(zero3_memory_worker, world, 3)):
        peak_param_bytes = m["shard_bytes"] + m["peak_gathered"]
        padding = m["shard_bytes"] - m["full_bytes"] / world
        assert m["peak_gathered"] > 0, m
        assert m["peak_gathered"] <= m["largest_layer"] * LAYER_SLACK, (rank, m)
        assert peak_param_bytes <= m["full_bytes"] / world + padding + m["largest_layer"] * LAYER_SLACK, (rank, m)


def test_zero2_gathers_every_parameter_for_the_whole_step():
    # The contrast that makes the ZeRO-3 bound meaningful: ZeRO-2 holds all full parameters at once.
    for m in run_ranks(zero3_memory_worker, 2, 2):
        assert m["peak_gathered"] >= m["all_params_padded"] - 1, m
