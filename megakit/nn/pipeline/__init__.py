"""Pipeline parallelism: the executor of a schedule's instructions, the outputs freed once sent, zero bubble's
split backward, and the stages' shared gradients."""
