"""The Mamba-2 mixer against transformers' own (``NemotronHMamba2Mixer``, its torch path), in fp32, over sequences
longer than the chunk, with A_log, dt_bias, D and the conv taps away from their initial values; packed documents
against transformers run on each document alone."""

from __future__ import annotations

import pytest
import torch

from megakit.core.mamba_config import Mamba2Config
from megakit.errors import UsageError

transformers = pytest.importorskip("transformers")


def _close(got, want, what):
    err, bound = (got - want).abs().max().item(), 1e-5 * want.abs().max().item() + 1e-9
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _hf_mixer(**changes):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    fields = dict(hidden_size=32, mamba_num_heads=8, mamba_head_dim=6, ssm_state_size=5, n_groups=2, chunk_size=8)
    config = NemotronHConfig(**{**fields, **changes}, layers_block_type=["linear_attention"], num_hidden_layers=1)
    torch.manual_seed(0)
    ref = NemotronHMamba2Mixer(config, layer_idx=0).float()
    with torch.no_grad():  # A_log, dt_bias, D, the conv taps and norm away from their initial values
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return config, ref


def _ours(config, ref):
    from megakit.interop.hf_mamba import mixer_from_hf
    from megakit.nn.linear_attention.mamba2 import Mamba2

    mamba = Mamba2Config.from_hf(config.to_dict())
    ours = Mamba2(
        mamba, 32, eps=1e-5, group=None, sequence_parallel=False, dtype=torch.float32, device=None, cp_group=None
    )
    ours.load_state_dict(mixer_from_hf(ref.state_dict(), mamba))
    return ours


@pytest.mark.parametrize("changes", [{}, {"time_step_limit": (0.05, 0.8), "conv_kernel": 3}])
def test_mixer_equals_transformers(changes):
    config, ref = _hf_mixer(**changes)
    ours = _ours(config, ref)
    h = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(1))  # 21 tokens: 2 chunks of 8 and a part
    _close(ours(h.transpose(0, 1)).transpose(0, 1), ref(h), f"mixer {changes}")


def test_documents_restart_the_state_and_the_conv():
    config, ref = _hf_mixer()
    ours = _ours(config, ref)
    h = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(2))
    documents = torch.tensor([[0] * 5 + [1] * 9 + [2] * 7, [0] * 13 + [1] * 8])  # ends inside and across chunks
    got = ours(h.transpose(0, 1), documents).transpose(0, 1)
    for row in range(2):
        for doc in documents[row].unique():
            inside = documents[row] == doc
            _close(got[row : row + 1, inside], ref(h[row : row + 1, inside]), f"row {row} document {doc}")


def test_heads_and_groups_must_divide():
    with pytest.raises(UsageError, match="Mamba-2 heads 6 must be a multiple of its groups 4"):
        Mamba2Config(heads=6, head_dim=4, state=4, groups=4)
    assert Mamba2Config(heads=8, head_dim=4, state=4, groups=2).split_conflicts(4) == ["Mamba groups 2"]
