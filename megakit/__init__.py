"""megakit: tensor, pipeline and ZeRO data parallelism combined, and a planner that picks the layout."""

__version__ = "0.1.0"
