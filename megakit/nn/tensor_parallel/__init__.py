"""Tensor parallelism (Megatron): the differentiable collectives, the layers built on them, the vocab-parallel loss
(whole or over token chunks), the overlapped column-parallel linears, and float8 GEMMs in the large linears."""
