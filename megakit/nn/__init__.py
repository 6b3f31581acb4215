"""The torch layer. At the top: the model, its blocks and Multi-Token Prediction, regional compilation, and what
every room below uses: the one door for communication (``comm``), process groups (``topology``), weight
initialisation, layout-free dropout, CP's split of the sequence (``sequence``) and DP's compression. Its rooms:
``attention``, ``tensor_parallel``, ``moe`` and ``pipeline``; pyproject.toml's import-linter contract puts each in
its tier."""
