"""Linear-attention and state-space mixers: Mamba-2 (``mamba2``)."""
