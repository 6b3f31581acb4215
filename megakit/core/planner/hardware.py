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
    """One GPU's speeds and sizes, the planner's hardware inputs (presets, or measured by ``megakit probe``)."""

    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core TFLOP/s
    mem_gib: float
    hbm_gbps: float  # memory bandwidth, GB/s
    intra_gbps: float  # per-GPU intra-node link, GB/s one direction
    inter_gbps: float  # per-GPU share of the inter-node network, GB/s one direction
    intra_link: str
    inter_link: str
    flash_attention: bool = True  # fused attention kernels available (FlashAttention-2 needs Ampere+)
    matmul_fraction: float = 0.80  # best large bf16 GEMM / datasheet peak (MAMF, see below)
    attention_fraction: float = 0.50  # best FlashAttention-2 forward+backward / datasheet peak
    fp32_rate: float = 0.5  # fp32 matmul rate / peak: TF32 tensor cores run at half the 16-bit rate
    fp8_tflops: float = 0.0  # dense FP8 tensor-core TFLOP/s (datasheet); 0: no FP8 tensor cores (A100, V100)
    mx_scaling: bool = False  # tensor cores that apply MX block scales (Blackwell: MXFP8); Hopper has none


# matmul_fraction: the Maximum Achievable Matmul FLOPS (MAMF) of a bf16 GEMM over the datasheet peak, as
# measured by stas00/ml-engineering (compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table"): A100 SXM 267.9/312 = 85.9 %, H100 SXM 792.1/989 = 80.1 %, H100/H200 SXM 80.3 %, A100
# PCIe 82.2 %, MI300X 60.1 %. GPUs the table lacks (V100, L40S, RTX 4090) take 0.80, an assumption.
# attention_fraction: FlashAttention-2 forward+backward, causal, head dim 128, at long sequences over the peak:
# the asymptote R of its own benchmark curves (compute.ATTENTION_SEQ_HALF; assets/flash2_a100_fwd_bwd_benchmark.png,
# flash2_h100_fwd_bwd_benchmark.png): A100 195/312 -> 0.62 ("50-73 %", Dao 2023, abstract); H100 339/989 -> 0.34
# ("only 35 % utilization on the H100", Shah et al. 2024, FlashAttention-3, Sec. 1), Hopper's SDPA runs FA-2.
# h100-96gb is Meta's Grand Teton H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit) that torchtitan's
# benchmarks ran on (torchtitan docs/performance.md): it computes at the lower clocks of the 500 W cap,
# 0.875 of the 700 W part's rates (0.70 = 0.801 x 0.875, attention 0.30 = 0.34 x 0.875); 0.875 is fitted to
# the twelve torchtitan rows of tests/data/sharded-dp.json, the only data on this part.
# fp8_tflops: dense FP8 datasheet peaks (H100/H200 SXM 1979, B200 4500, MI300X 2615, L40S 733, RTX 4090 330);
# FP8 GEMMs reach the same matmul_fraction of it (compute.FP8_GEMM says what scaling costs on top).
# b200-180gb: HGX B200 datasheet (2.25 PF dense bf16, 8 TB/s, NVLink 5 at 900 GB/s a direction); no MAMF
# published for it here, so 0.80 and Hopper's attention fraction are assumptions.
GPUS = {
    g.name: g
    for g in (
        GPU(
            name="v100-32gb",
            peak_tflops=125,
            mem_gib=32,
            hbm_gbps=900,
            intra_gbps=150,
            inter_gbps=12.5,
            intra_link="NVLink 2",
            inter_link="100 Gb/s EDR InfiniBand per GPU",
            flash_attention=False,
            matmul_fraction=0.80,
            attention_fraction=0.0,
        ),
        GPU(
            name="a100-40gb",
            peak_tflops=312,
            mem_gib=40,
            hbm_gbps=1555,
            intra_gbps=300,
            inter_gbps=25,
            intra_link="NVLink 3 / NVSwitch",
            inter_link="200 Gb/s HDR InfiniBand per GPU",
            matmul_fraction=0.859,
            attention_fraction=0.62,
        ),
        GPU(
            name="a100-80gb",
            peak_tflops=312,
            mem_gib=80,
            hbm_gbps=2039,
            intra_gbps=300,
            inter_gbps=25,
            intra_link="NVLink 3 / NVSwitch",
            inter_link="200 Gb/s HDR InfiniBand per GPU",
            matmul_fraction=0.859,
            attention_fraction=0.62,
        ),
        GPU(
            name="h100-80gb",
            peak_tflops=989,
            mem_gib=80,
            hbm_gbps=3350,
            intra_gbps=450,
            inter_gbps=50,
            intra_link="NVLink 4 / NVSwitch",
            inter_link="400 Gb/s NDR InfiniBand per GPU",
            matmul_fraction=0.801,
            attention_fraction=0.34,
            fp8_tflops=1979,
        ),
        GPU(
            name="h100-96gb",
            peak_tflops=989,
            mem_gib=95,
            hbm_gbps=2400,
            intra_gbps=450,
            inter_gbps=50,
            intra_link="NVLink 4 / NVSwitch",
            inter_link="400 Gb/s RDMA per GPU (Grand Teton, 500 W)",
            matmul_fraction=0.70,
            attention_fraction=0.30,
            fp8_tflops=1979,
        ),
        GPU(
            name="h200-141gb",
            peak_tflops=989,
            mem_gib=140,
            hbm_gbps=4800,
            intra_gbps=450,
            inter_gbps=50,
            intra_link="NVLink 4 / NVSwitch",
            inter_link="400 Gb/s NDR InfiniBand per GPU",
            matmul_fraction=0.803,
            attention_fraction=0.34,
            fp8_tflops=1979,
        ),
        GPU(
            name="b200-180gb",
            peak_tflops=2250,
            mem_gib=178,
            hbm_gbps=8000,
            intra_gbps=900,
            inter_gbps=50,
            intra_link="NVLink 5 / NVSwitch",
            inter_link="400 Gb/s NDR InfiniBand per GPU",
            matmul_fraction=0.80,
            attention_fraction=0.34,
            fp8_tflops=4500,
            mx_scaling=True,
        ),
        GPU(
            name="mi300x-192gb",
            peak_tflops=1307,
            mem_gib=192,
            hbm_gbps=5300,
            intra_gbps=448,
            inter_gbps=50,
            intra_link="Infinity Fabric",
            inter_link="400 Gb/s RoCE per GPU",
            matmul_fraction=0.601,
            attention_fraction=0.35,
            fp8_tflops=2615,
        ),
        GPU(
            name="l40s-48gb",
            peak_tflops=362,
            mem_gib=45,
            hbm_gbps=864,
            intra_gbps=25,
            inter_gbps=12.5,
            intra_link="PCIe 4.0 x16",
            inter_link="100 Gb/s Ethernet per GPU",
            matmul_fraction=0.80,
            attention_fraction=0.50,
            fp8_tflops=733,
        ),
        GPU(
            name="rtx4090-24gb",
            peak_tflops=165,
            mem_gib=24,
            hbm_gbps=1008,
            intra_gbps=25,
            inter_gbps=3.1,
            intra_link="PCIe 4.0 x16",
            inter_link="25 Gb/s Ethernet per GPU",
            matmul_fraction=0.80,
            attention_fraction=0.50,
            fp8_tflops=330,
        ),
    )
}


def gpu_preset(name: str) -> GPU:
    """The GPU preset named by ``--gpu``; UsageError lists the known ones otherwise."""
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
        """This cluster with the GPU's figures the user gave on the command line in place of the preset's."""
        changes = {
            k: v
            for k, v in dict(
                mem_gib=mem_gib, intra_gbps=intra_gbps, inter_gbps=inter_gbps, peak_tflops=peak_tflops
            ).items()
            if v is not None
        }
        for key, value in changes.items():
            if not value > 0:
                raise UsageError(f"--{key.replace('_', '-')} must be positive, got {value}")
        return dataclasses.replace(self, gpu=dataclasses.replace(self.gpu, **changes)) if changes else self


PROFILE_KEYS = ("matmul_tflops", "copy_gbps", "attention_tflops", "memory_gib", "gpus_per_node", "dtype", "links")


def gpu_from_profile(profile: dict, *, source: str = "profile", link_efficiency: dict) -> tuple[GPU, int]:
    """(the GPU ``megakit probe`` measured, its GPUs per node): rates as measured, so the planner's
    efficiencies see the measured best matmul as the achievable peak and the measured bus bandwidths
    as what its collectives reach (``link_efficiency`` undone). One node was measured: the network
    across nodes is taken as the intra-node one, and said so."""
    if not isinstance(profile, dict) or profile.get("profile") != "megakit-probe":
        raise UsageError(f"{source} is not a megakit probe profile; write one with megakit probe --nproc N --out FILE")
    missing = [k for k in PROFILE_KEYS if k not in profile]
    if missing:
        raise UsageError(f"{source} lacks {', '.join(missing)}; run megakit probe again to rewrite it")
    peak = float(profile["matmul_tflops"])
    links = profile["links"]
    bus = links.get("all_reduce", {}).get("bus_gbps")  # the collective DP and TP run most
    if bus is None:
        bus = 1e3  # one process: no link measured, and none used
    intra = bus / link_efficiency["intra"]
    name = f"probed:{profile.get('device', 'device')}"
    gpu = GPU(
        name=name,
        peak_tflops=peak,
        mem_gib=float(profile["memory_gib"]),
        hbm_gbps=float(profile["copy_gbps"]),
        intra_gbps=intra,
        inter_gbps=bus / link_efficiency["inter"],
        intra_link=f"{profile.get('backend', '?')} between {profile.get('nproc', '?')} processes, measured "
        f"{bus:.2f} GB/s bus bandwidth",
        inter_link="not measured (one node): taken as intra-node",
        flash_attention=True,
        matmul_fraction=1.0,
        attention_fraction=min(1.0, float(profile["attention_tflops"]) / peak),
        fp32_rate=1.0 if profile["dtype"] == "fp32" else 0.5,
    )
    return gpu, int(profile["gpus_per_node"])
