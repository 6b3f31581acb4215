"""A hybrid model's blocks counted one by one: ``layer_params(config, i)`` is block ``i``'s own (Gated DeltaNet or
attention with its MLP kind; Nemotron-H's one part), the blocks sum to the model's, and the pipeline split balances
by them (the largest stage as small as any split makes it), not by a mean block."""

from __future__ import annotations

import itertools

import pytest

from megakit.core.model_config import ModelConfig
from megakit.core.partition import partition_layers


def _blocks_total(config: ModelConfig) -> int:
    return config.num_params() - config.embedding_params() - config.head_params(separate=not config.tie_embeddings)


def _best_largest_stage(own: list[float], embedding: float, head: float, stages: int) -> float:
    """The smallest largest stage cost over every contiguous split into ``stages`` (brute force)."""
    prefix = list(itertools.accumulate(own, initial=0.0))
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(len(own) + 1), stages - 1):
        bounds = (0, *cuts, len(own))
        costs = [prefix[j] - prefix[i] for i, j in itertools.pairwise(bounds)]
        costs[0], costs[-1] = costs[0] + embedding, costs[-1] + head
        best = min(best, max(costs))
    return best


@pytest.mark.parametrize("name", ["nemotron-h-8b", "nemotron-3-nano-30b-a3b", "qwen3.5-9b", "qwen3-next-tiny"])
def test_each_block_counts_its_own_parts_and_they_sum_to_the_model(name):
    config = ModelConfig.load(name)
    own = [config.layer_params(i) for i in range(config.layers)]
    assert sum(own) == _blocks_total(config)
    if config.layer_pattern:  # Nemotron-H 8B: "M-M-..." a Mamba-2 block, an MLP one, and attention at 4
        assert own[0] != own[1] and own[config.layer_pattern.index("*")] not in (own[0], own[1])
    else:  # Qwen: Gated DeltaNet in three blocks of four, attention in the fourth
        assert own[0] != own[config.linear.layer_types.index("full_attention")]


@pytest.mark.parametrize("method", ["params", "flops"])
def test_a_hybrid_pipeline_split_balances_its_real_blocks(method):
    """Nemotron-H 8B at PP 4 (a Mamba-2 block weighs 4x an MLP block): the mean block split 11, 15, 15, 11."""
    config = ModelConfig.load("nemotron-h-8b")
    if method == "params":
        own = [float(config.layer_params(i)) for i in range(config.layers)]
        embedding, head = float(config.embedding_params()), float(config.head_params(separate=True))
    else:
        own = [config.own_block_flops(i, config.max_seq_len) for i in range(config.layers)]
        embedding, head = 0.0, float(config.head_flops())
    ranges = partition_layers(config, 4, method=method)
    costs = [sum(own[i] for i in r) for r in ranges]
    costs[0], costs[-1] = costs[0] + embedding, costs[-1] + head
    assert max(costs) == pytest.approx(_best_largest_stage(own, embedding, head, 4), rel=1e-12)
