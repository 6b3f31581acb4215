"""Attention: the core layer and its masks, Multi-head Latent Attention, the kernel choice, and attention over a
sequence split by context parallelism (the ring, its transport, Ulysses' all-to-all of heads)."""
