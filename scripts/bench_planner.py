"""Time the planner's full search for the Megatron 1T model on 3072 A100-80GB (Narayanan et al. 2021's
largest run), single-threaded. Prints the plan, the layouts evaluated and the wall time; last line
``seconds <number>``. Target: < 0.5 s on one core."""

import argparse
import sys
import time

from megakit.errors import UsageError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1T")
    parser.add_argument("--gpus", type=int, default=3072)
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--global-batch", type=int, default=3072)
    parser.add_argument("--repeat", type=int, default=3, help="report the fastest of this many runs")
    args = parser.parse_args(argv)
    from megakit.core.planner.hardware import Cluster, gpu_preset
    from megakit.core.planner.model_spec import ModelSpec
    from megakit.core.planner.search import search

    try:
        model = ModelSpec.from_params(args.params)
        cluster = Cluster(gpu=gpu_preset(args.gpu), num_gpus=args.gpus)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = search(model, cluster, global_batch=args.global_batch)
            times.append(time.perf_counter() - start)
    except UsageError as error:
        print(f"bench_planner: error: {error}", file=sys.stderr)
        return 2
    best = result.best
    print(
        f"model {model.name} ({model.params / 1e9:.0f}B params) on {args.gpus} x {args.gpu}, "
        f"global batch {args.global_batch}"
    )
    print(
        f"plan {best.plan.describe()}: {best.cost.tokens_per_s:,.0f} tokens/s, "
        f"{best.cost.hardware_tflops_per_gpu:.0f} hardware TFLOP/s per GPU, peak {best.memory.total / 2**30:.1f} GiB"
    )
    print(f"layouts evaluated {result.evaluated}, feasible {len(result.ranked)}, rejected {len(result.rejected)}")
    print(f"runs {', '.join(f'{t:.3f}' for t in times)} s; target 0.5 s, ratio {min(times) / 0.5:.3f}")
    print(f"seconds {min(times):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
