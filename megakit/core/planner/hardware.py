"""GPU and interconnect presets, and the cluster the planner plans for.

Figures are vendor datasheet numbers for dense (no sparsity) 16-bit tensor-core
math, usable memory as the driver reports it (GiB), HBM bandwidth, and per-GPU
link bandwidth in GB/s in one direction: ``intra`` is the GPU-to-GPU link inside
a node (NVLink/NVSwitch, Infinity Fabric, or PCIe), ``inter`` is this GPU's share
of the node's network (e.g. Selene/DGX A100: 8 x 200 Gb/s HDR per 8 GPUs =
25 GB/s per GPU). Any of them can be overridden on the command line.
"""

from __future__ import annotations

import dataclasses

from megakit.errors import UsageError


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core TFLOP/s
    mem_gib: float
    hbm_gbps: float  # memory bandwidth, GB/s
    intra_gbps: float  # per-GPU intra-node link, GB/s one direction
    inter_gbps: float  # per-GPU share of the inter-node network, GB/s one direction
    intra_link: str
    inter_link: str
    flash_attention: bool = True  # fused attention kernels available (FlashAttention-2 needs Ampere+)


GPUS = {
    g.name: g
    for g in (
        GPU(name="v100-32gb", peak_tflops=125, mem_gib=32, hbm_gbps=900, intra_gbps=150, inter_gbps=12.5,
            intra_link="NVLink 2", inter_link="100 Gb/s EDR InfiniBand per GPU", flash_attention=False),
        GPU(name="a100-40gb", peak_tflops=312, mem_gib=40, hbm_gbps=1555, intra_gbps=300, inter_gbps=25,
            intra_link="NVLink 3 / NVSwitch", inter_link="200 Gb/s HDR InfiniBand per GPU"),
        GPU(name="a100-80gb", peak_tflops=312, mem_gib=80, hbm_gbps=2039, intra_gbps=300, inter_gbps=25,
            intra_link="NVLink 3 / NVSwitch", inter_link="200 Gb/s HDR InfiniBand per GPU"),
        GPU(name="h100-80gb", peak_tflops=989, mem_gib=80, hbm_gbps=3350, intra_gbps=450, inter_gbps=50,
            intra_link="NVLink 4 / NVSwitch", inter_link="400 Gb/s NDR InfiniBand per GPU"),
        GPU(name="h200-141gb", peak_tflops=989, mem_gib=140, hbm_gbps=4800, intra_gbps=450, inter_gbps=50,
            intra_link="NVLink 4 / NVSwitch", inter_link="400 Gb/s NDR InfiniBand per GPU"),
        GPU(name="mi300x-192gb", peak_tflops=1307, mem_gib=192, hbm_gbps=5300, intra_gbps=448, inter_gbps=50,
            intra_link="Infinity Fabric", inter_link="400 Gb/s RoCE per GPU"),
        GPU(name="l40s-48gb", peak_tflops=362, mem_gib=45, hbm_gbps=864, intra_gbps=25, inter_gbps=12.5,
            intra_link="PCIe 4.0 x16", inter_link="100 Gb/s Ethernet per GPU"),
        GPU(name="rtx4090-24gb", peak_tflops=165, mem_gib=24, hbm_gbps=1008, intra_gbps=25, inter_gbps=3.1,
            intra_link="PCIe 4.0 x16", inter_link="25 Gb/s Ethernet per GPU"),
    )
}


def gpu_preset(name: str) -> GPU:
    key = name.strip().lower()
    if key not in GPUS:
        raise UsageError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)}")
    return GPUS[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """``num_gpus`` GPUs of one kind, ``gpus_per_node`` to a node."""

    gpu: GPU
    num_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self):
        if self.num_gpus < 1:
            raise UsageError(f"the cluster needs at least one GPU, got {self.num_gpus}")
        if self.gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")

    @property
    def nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def link_gbps(self, span: int, stride: int = 1) -> float:
        """Bandwidth of a group of ``span`` ranks whose members are ``stride`` ranks apart:
        the intra-node link if the whole group sits inside one node, else the network."""
        if span <= 1:
            return float("inf")
        return self.gpu.intra_gbps if span * stride <= self.gpus_per_node else self.gpu.inter_gbps

    def with_overrides(self, *, mem_gib=None, intra_gbps=None, inter_gbps=None, peak_tflops=None) -> "Cluster":
        changes = {k: v for k, v in dict(mem_gib=mem_gib, intra_gbps=intra_gbps, inter_gbps=inter_gbps,
                                         peak_tflops=peak_tflops).items() if v is not None}
        for key, value in changes.items():
            if not value > 0:
                raise UsageError(f"--{key.replace('_', '-')} must be positive, got {value}")
        return dataclasses.replace(self, gpu=dataclasses.replace(self.gpu, **changes)) if changes else self
