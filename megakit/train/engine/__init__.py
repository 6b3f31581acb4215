"""DeepSpeed's engine and what megakit adds around it: the ds_config it reads, the optimizer's groups and
schedule, its expert machinery for megakit's MoE layers, ZeRO-3's linears, its /dev/shm buffers, who keeps the
DP replicas in step, the gradient norm megakit clips by, and the MoE layers' part in each step.

Imports megakit's lower layers (core, nn, interop) only: no other room of ``train``, no entry point."""
