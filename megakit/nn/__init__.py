"""The torch layer: the one door for communication (``comm``), process groups, tensor-parallel
layers, weight initialisation, layout-free dropout, the model and the pipeline executor."""
