"""Context parallelism on real gloo processes: CP = 2 and 4, and CP 2 x TP 2, against one process (fp32).

One spawn of four ranks sweeps every case (CP 4; CP 2 x TP 2 with and without sequence
parallelism; CP 2 x DP 2, i.e. two CP 2 rings; sliding windows, RoPE scaling, GPT-2's score
scaling). Under CP each rank's gradient is CP times its share of the sequence's (DeepSpeed
averages over DP x CP), so the test averages the gradients over the CP group and compares
them with the single process's. Tolerance as in
``test_tensor_parallel``: ``|a - b| <= 1e-5 * max|b| + 1e-9`` per tensor.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks

from megakit.nn.context_parallel import positions

RTOL, FLOOR = 1e-5, 1e-9


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got - want).abs().max().item()
    bound = RTOL * want.abs().max().item() + FLOOR
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def test_load_balanced_split_covers_the_sequence_once():
    held = [positions(16, 4, r).tolist() for r in range(4)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(sum(held, [])) == list(range(16))


def _equivalence(topo, preset: str, *, sequence_parallel: bool = False, dropout: float = 0.0,
                 recompute: str = "none", cp_mode: str = "ring", seq: int = 16, **changes) -> str:
    import torch.distributed as dist

    from megakit.nn import comm as C
    from megakit.nn.context_parallel import gather_sequence
    from megakit.nn.attention import use_cp_mode
    from megakit.nn.model import ModelConfig, Transformer, full_state_dict

    config = ModelConfig.load(preset).replace(vocab_size=250, dropout=dropout, **changes)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 250, (2, seq), generator=gen)
    labels = torch.randint(0, 250, (2, seq), generator=gen)
    labels[0, :3] = -100  # ignored tokens (all in CP rank 0's first chunk) are left out of the mean
    labels[1, 9] = -100
    ref = Transformer(config, seed=3)
    model = Transformer(config, topo, seed=3, sequence_parallel=sequence_parallel, recompute=recompute)
    if config.attention_sinks:  # drawn near the rows' log-sum-exp (about ln 16), so sigmoid(lse - sink) spans 0.1-0.9
        with torch.no_grad():
            for i, block in ref.layers.items():
                sinks = 2.8 + torch.randn(config.heads, generator=torch.Generator().manual_seed(int(i)))
                block.attn.sinks.copy_(sinks)
                model.layers[i].attn.sinks.copy_(sinks.chunk(topo.tp)[topo.tp_rank])
    use_cp_mode(model, cp_mode, topo)
    case = (f"{preset} cp={topo.cp} ({cp_mode}) tp={topo.tp} sp={sequence_parallel} dropout={dropout} "
            f"recompute={recompute} {changes}")
    rows = {"sample_ids": [11, 12]}

    want_logits, got = ref(ids, **rows), model(ids, **rows)  # (B, S, V) vs (B, S/cp, V/tp)
    got = gather_sequence(got, topo.cp_group, dim=1)
    if topo.tp > 1:
        parts = [torch.empty_like(got) for _ in range(topo.tp)]
        dist.all_gather(parts, got.contiguous(), group=topo.tp_group)
        got = torch.cat(parts, dim=-1)
    _close(got[..., :250], want_logits[..., :250], f"{case} logits")

    want_loss, loss = ref(ids, labels, **rows), model(ids, labels, **rows)
    _close(loss.detach(), want_loss.detach(), f"{case} loss")  # the whole sequence's mean, on every CP rank
    want_loss.backward()
    loss.backward()
    grads, ref_grads = full_state_dict(model, topo, grads=True), full_state_dict(ref, grads=True)
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        mean = C.all_reduce(grads[name].clone(), topo.cp_group) / topo.cp
        _close(mean, want, f"{case} grad of {name}")
    return case


def _sweep(rank, world_size, root):
    from megakit.core.layout import Layout
    from megakit.core.rope import RopeScaling
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.errors import UsageError
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.nn.topology import Topology

    cp4, cp2tp2, cp2dp2 = Topology(Layout(cp=4)), Topology(Layout(tp=2, cp=2)), Topology(Layout(cp=2, dp=2))
    hybrid = Topology(Layout(cp=4, cp_a2a=2))  # a2a inside CP ranks {0, 1} and {2, 3}, rings {0, 2} and {1, 3}
    done = []
    for preset in ("gpt-tiny", "llama-tiny"):  # llama-tiny: 8 heads over 4 KV heads (GQA)
        done.append(_equivalence(cp4, preset))
        done.append(_equivalence(cp2tp2, preset))
        done.append(_equivalence(cp2tp2, preset, sequence_parallel=True))
        done.append(_equivalence(cp2dp2, preset))
    done.append(_equivalence(cp2tp2, "llama-tiny", sequence_parallel=True, dropout=0.1))  # residual + attention
    done.append(_equivalence(cp4, "gpt-tiny", dropout=0.1, recompute="full"))
    # a sliding window shorter than the sequence (masked in the ring; Qwen2's: blocks 1 on), Llama 3.1's RoPE
    # at the rank's global positions, GPT-2's score scaling; with dropout the single process writes attention out
    llama3 = RopeScaling("llama3", (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                    ("original_max_position_embeddings", 4)))
    done.append(_equivalence(cp4, "llama-tiny", sliding_window=5, sliding_window_from=1, rope_theta=5e5,
                             rope_scaling=llama3))
    done.append(_equivalence(cp2tp2, "llama-tiny", dropout=0.1, sliding_window=3))
    done.append(_equivalence(cp2dp2, "gpt-tiny", dropout=0.1, scale_attn_weights=False,
                             scale_attn_by_inverse_layer_idx=True))
    # Ulysses (--cp-mode a2a): MHA and GQA at CP 4 (llama-tiny's 4 KV heads split; 2 KV heads, fewer than CP 4,
    # replicated per query head), under TP 2 with SP, with dropout, a window and full recompute
    done.append(_equivalence(cp4, "gpt-tiny", cp_mode="a2a"))
    done.append(_equivalence(cp4, "llama-tiny", cp_mode="a2a"))
    done.append(_equivalence(cp4, "llama-tiny", cp_mode="a2a", kv_heads=2, sliding_window=5))
    done.append(_equivalence(cp2tp2, "llama-tiny", cp_mode="a2a", sequence_parallel=True, dropout=0.1))
    done.append(_equivalence(cp2dp2, "gpt-tiny", cp_mode="a2a", dropout=0.1, recompute="full"))
    # hybrid 2 x 2 (USP): MHA; GQA with one KV head (replicated for the a2a) and a window; dropout (the explicit
    # ring's blocks), each rank's mask cut from the draw at its head group and its ring rows
    done.append(_equivalence(hybrid, "gpt-tiny", cp_mode="hybrid"))
    done.append(_equivalence(hybrid, "llama-tiny", cp_mode="hybrid", kv_heads=1, sliding_window=5))
    done.append(_equivalence(hybrid, "llama-tiny", cp_mode="hybrid", dropout=0.1))
    # Gemma 3 (5 sliding : 1 full, window 8 at 16 tokens: zig-zag chunks of 2 and 4, shorter than it; local and
    # global RoPE at the global positions; sandwich and (1 + w) norms) on the ring and on Ulysses under TP
    done.append(_equivalence(cp4, "gemma3-tiny"))
    done.append(_equivalence(cp2tp2, "gemma3-tiny", cp_mode="a2a", sequence_parallel=True))
    # gpt-oss's attention sinks (with a window): the ring at CP 4, CP 2 x TP 2 (sinks split with the heads) with SP,
    # Ulysses (each rank's head group's sinks), hybrid, and dropout (the explicit ring's blocks)
    sinks = dict(attention_sinks=True, sliding_window=5)
    done.append(_equivalence(cp4, "llama-tiny", **sinks))
    done.append(_equivalence(cp2tp2, "llama-tiny", sequence_parallel=True, **sinks))
    done.append(_equivalence(cp4, "llama-tiny", cp_mode="a2a", **sinks))
    done.append(_equivalence(hybrid, "llama-tiny", cp_mode="hybrid", **sinks))
    done.append(_equivalence(cp2dp2, "llama-tiny", dropout=0.1, **sinks))
    done.append(_equivalence(cp2tp2, "gpt-oss-tiny", sequence_parallel=True))  # its window 8 over chunks of 4
    done.append(_equivalence(cp2tp2, "gpt-oss-tiny", seq=64))  # chunks of 16: the window inside and across them
    # DeepSeek-V3's MLA: keys of 24, values of 16 (the ring pads them), the shared RoPE key at global positions
    done.append(_equivalence(cp2dp2, "deepseek-v3-tiny"))
    done.append(_equivalence(cp2tp2, "deepseek-v3-tiny", sequence_parallel=True))
    done.append(_equivalence(cp4, "deepseek-v3-tiny", cp_mode="a2a", dropout=0.1))
    # a checkpoint saved at CP 2 x TP 2: CP ranks hold the same weights, so one of them writes
    config = ModelConfig.load("llama-tiny")
    save_checkpoint(f"{root}/cp2tp2", Transformer(config, cp2tp2, seed=21), cp2tp2, step=1, config=config)
    model = Transformer(ModelConfig.load("gpt-tiny"), cp4)
    try:
        model(torch.zeros((1, 12), dtype=torch.long))
    except UsageError as error:
        done.append(str(error))
    return done


def test_context_parallel_matches_one_process(tmp_path):
    from megakit.interop.checkpoint import load_checkpoint
    from megakit.nn.model import ModelConfig, Transformer, full_state_dict

    results = run_ranks(_sweep, 4, str(tmp_path), timeout_s=400)
    assert len(results[0]) == 34
    assert "not divisible by 2 x CP = 8" in results[0][-1]
    loaded = Transformer(ModelConfig.load("llama-tiny"), seed=0)
    load_checkpoint(tmp_path / "cp2tp2", loaded)
    want = full_state_dict(Transformer(ModelConfig.load("llama-tiny"), seed=21))
    assert all(torch.equal(t, want[name]) for name, t in full_state_dict(loaded).items())


@pytest.mark.parametrize("cp", [2, 4])
def test_layout_places_cp_groups_next_to_tp(cp):
    from megakit.core.layout import Layout

    layout = Layout(tp=2, cp=cp, dp=2)
    assert layout.groups("cp")[0] == [2 * i for i in range(cp)]  # CP after TP: inside a node of 2 x CP GPUs
    for kind in ("tp", "cp", "dp", "dpcp", "pp", "mp"):
        assert sorted(r for g in layout.groups(kind) for r in g) == list(range(layout.world_size)), kind
    for rank in range(layout.world_size):
        assert layout.rank(**layout.coords(rank)) == rank
