"""Layout-free dropout masks: a function of (seed, site, sample[, head]) only, whatever slice a rank holds."""

import torch

from megakit.nn.dropout import (
    DropoutKeys,
    attention_dropout,
    keep_mask,
    residual_dropout,
)


def test_masks_depend_on_seed_site_and_sample_only():
    keys = DropoutKeys.of(3, [10, 11])
    a = keep_mask(0.25, keys, site="layers.0.mlp_residual", streams=keys.samples, full_shape=(64, 32))
    assert a.shape == (2, 64, 32) and a.dtype == torch.bool
    assert torch.equal(
        a, keep_mask(0.25, keys, site="layers.0.mlp_residual", streams=keys.samples, full_shape=(64, 32))
    )
    assert abs(a.float().mean().item() - 0.75) < 0.02  # kept with probability 1 - p
    assert not torch.equal(a[0], a[1])  # each sample its own mask
    other_site = keep_mask(0.25, keys, site="layers.1.mlp_residual", streams=keys.samples, full_shape=(64, 32))
    other_seed = keep_mask(
        0.25, DropoutKeys.of(4, [10, 11]), site="layers.0.mlp_residual", streams=[10, 11], full_shape=(64, 32)
    )
    assert not torch.equal(a, other_site) and not torch.equal(a, other_seed)


def test_a_slice_of_the_sequence_or_the_heads_gets_its_part_of_the_whole_mask():
    keys = DropoutKeys.of(0, [5, 9, 2])
    x = torch.randn(8, 3, 16)  # (S, B, H)
    whole = residual_dropout(x, 0.5, keys, site="embed")
    for rank in range(4):  # sequence parallelism over 4 ranks: rows 2r, 2r+1
        rows = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(
            residual_dropout(x[rows], 0.5, keys, site="embed", seq_start=2 * rank, seq_len=8), whole[rows]
        )
    assert torch.equal(whole[whole != 0], x[whole != 0] * 2)  # kept units scaled by 1 / (1 - p)
    probs = torch.rand(3, 6, 8, 8)  # (B, heads, S, S)
    all_heads = attention_dropout(probs, 0.1, keys, site="a", head_start=0, heads=6)
    for start in (0, 2, 4):  # TP 3: two heads per rank
        part = attention_dropout(probs[:, start : start + 2], 0.1, keys, site="a", head_start=start, heads=6)
        assert torch.equal(part, all_heads[:, start : start + 2])


def test_the_default_generator_is_never_drawn_from():
    state = torch.get_rng_state()
    residual_dropout(torch.ones(4, 2, 8), 0.3, DropoutKeys.of(1, [0, 1]), site="x")
    assert torch.equal(torch.get_rng_state(), state)
