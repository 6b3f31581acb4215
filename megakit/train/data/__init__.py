"""What a step trains on: ``--data`` opened as a corpus, cut into batches dealt out to DP ranks, and the step's
loss weighted by its valid tokens.

Imports megakit's lower layers (core, nn, interop) only: no other room of ``train``, no entry point."""
