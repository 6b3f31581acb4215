"""The planner: pure-Python arithmetic that picks TP × PP × DP × ZeRO for a model and a cluster.

``model_spec`` (the model), ``hardware`` (GPUs, cluster), ``memory`` (per-GPU bytes of one
layout and stage), ``cost`` (step time), ``search`` (the seed's rule, enumerate, prune, rank),
``emit`` (ds_config, launch command, tips), ``command`` (``megakit plan``). No torch import.
"""
