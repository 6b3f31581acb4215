"""The machine the job runs on: where each rank sits (node and host) and how fast the machine is
(``megakit probe``).

Imports megakit's lower layers (core, nn, interop) only: no other room of ``train``, no entry point."""
