"""``megakit probe --nproc 2`` on this CPU machine: two gloo processes measure, a profile is written, and
``megakit plan --hardware`` plans with it (timing targets live in scripts/bench_scaling.py)."""

import json
import statistics
import time

import pytest
import torch

from megakit.commands import cli


def test_probe_writes_a_profile_that_plan_uses(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "hw.json"
    code = cli.main(
        [
            "probe",
            "--nproc",
            "2",
            "--out",
            str(out),
            "--hidden",
            "128",
            "--tokens",
            "256",
            "--bytes",
            str(2**20),
            "--repeat",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0 and f"wrote {out}" in printed
    profile = json.loads(out.read_text())
    assert profile["profile"] == "megakit-probe" and profile["nproc"] == 2 and profile["backend"] == "gloo"
    assert [(m["m"], m["k"], m["n"]) for m in profile["matmul"]] == [
        (256, 128, 128),
        (256, 128, 512),
        (256, 512, 128),
        (512, 256, 256),
    ]
    assert profile["matmul_tflops"] == statistics.median(m["tflops"] for m in profile["matmul"])
    here = _matmul_tflops(256, 128, 512)  # the same multiply timed in this process, on one thread
    assert here / 10 < profile["matmul_tflops"] < 10 * here, (profile["matmul"], here)
    assert 0.1 < profile["copy_gbps"] < 1000, profile["copy_gbps"]  # DRAM, read + write
    assert profile["matmul_tflops"] / 1000 < profile["attention_tflops"] < 2 * profile["matmul_tflops"]
    links = profile["links"]
    assert set(links) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    factors = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "p2p": 1.0}  # 2 ranks (nccl-tests)
    for kind, link in links.items():  # each the slowest rank's; rank 0's own time bounds it
        assert link["bytes"] == 2**20 and link["seconds"] > 0, (kind, link)
        assert link["bus_gbps"] <= factors[kind] * link["bytes"] / link["seconds"] / 1e9 * (1 + 1e-9), (kind, link)
        assert 1e-3 < link["bus_gbps"] < 1000, (kind, link)  # loopback TCP
    rates = [v["bus_gbps"] for v in links.values()]
    assert max(rates) < 50 * min(rates), links  # one link, four ways of using it

    code = cli.main(
        [
            "plan",
            "--model",
            "gpt-mini",
            "--hardware",
            str(out),
            "--gpus",
            "2",
            "--global-batch",
            "8",
            "--seq-len",
            "128",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    cluster = report["assumptions"]["cluster"]
    assert cluster["gpu"].startswith("probed:cpu") and cluster["gpus_per_node"] == 2
    assert cluster["peak_tflops"] == pytest.approx(profile["matmul_tflops"])
    assert report["assumptions"]["precision"] == "fp32"  # what the CPU measured and trains in
    assert report["plan"]["dp"] == 2 and report["plan"]["step_time_s"] > 0


def _matmul_tflops(m: int, k: int, n: int) -> float:
    torch.set_num_threads(1)
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e12


BAD = [
    (["probe", "--nproc", "0", "--out", "x.json"], "--nproc must be a positive integer"),
    (["probe", "--nproc", "1", "--out", "x.txt"], "should name a .json file"),
    (["plan", "--params", "1B", "--hardware", "no/such.json"], "cannot read --hardware no/such.json"),
    (["plan", "--params", "1B", "--hardware", "models/gpt-tiny.json"], "is not a megakit probe profile"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_probe_input_is_one_line_exit_2(argv, needle, capsys):
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err
