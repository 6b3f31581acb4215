"""megakit: tensor, pipeline and ZeRO data parallelism combined, and a planner that picks the layout."""

__version__ = "0.1.0"

import logging as _logging


class _ImportNoise(_logging.Filter):
    """Drops two warnings that every command would print once transformers imports torchao (its quantizers
    do, whenever torchao is installed): torchao's optional CUDA extensions built for another Python, and
    torch's note on how torchao registers its enums. Neither concerns code megakit runs; other records pass."""

    NOISE = ("Failed to load ", "is an Enum subclass and is now natively supported")

    def filter(self, record: _logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in self.NOISE)


for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).addFilter(_ImportNoise())
