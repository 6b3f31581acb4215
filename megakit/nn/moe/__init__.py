"""Mixture of Experts: the layer, its router, the token dispatchers, and the experts' grouped GEMM."""
