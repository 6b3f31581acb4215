"""Linear-attention mixers (Gated DeltaNet, Mamba-2): the short causal conv they share, their chunked recurrences, and
context parallelism for them by an all-to-all of heads."""
