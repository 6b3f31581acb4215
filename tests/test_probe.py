"""``megakit probe --nproc 2`` on this CPU machine: two gloo processes measure, a profile is written, and
``megakit plan --hardware`` plans with it (timing targets live in scripts/bench_scaling.py)."""

import json

import pytest

from megakit.commands import cli


def test_probe_writes_a_profile_that_plan_uses(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "hw.json"
    code = cli.main(["probe", "--nproc", "2", "--out", str(out), "--hidden", "128", "--tokens", "256",
                     "--bytes", str(2**20), "--repeat", "2"])
    printed = capsys.readouterr().out
    assert code == 0 and f"wrote {out}" in printed
    profile = json.loads(out.read_text())
    assert profile["profile"] == "megakit-probe" and profile["nproc"] == 2 and profile["backend"] == "gloo"
    assert profile["matmul_tflops"] > 0 and profile["copy_gbps"] > 0 and profile["attention_tflops"] > 0
    assert set(profile["links"]) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    assert all(v["bus_gbps"] > 0 for v in profile["links"].values())
    assert [sorted(m) for m in profile["matmul"]] == [["k", "m", "n", "tflops"]] * 4

    code = cli.main(["plan", "--model", "gpt-mini", "--hardware", str(out), "--gpus", "2", "--global-batch", "8",
                     "--seq-len", "128", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    cluster = report["assumptions"]["cluster"]
    assert cluster["gpu"].startswith("probed:cpu") and cluster["gpus_per_node"] == 2
    assert cluster["peak_tflops"] == pytest.approx(profile["matmul_tflops"])
    assert report["assumptions"]["precision"] == "fp32"  # what the CPU measured and trains in
    assert report["plan"]["dp"] == 2 and report["plan"]["step_time_s"] > 0


BAD = [(["probe", "--nproc", "0", "--out", "x.json"], "--nproc must be a positive integer"),
       (["probe", "--nproc", "1", "--out", "x.txt"], "should name a .json file"),
       (["plan", "--params", "1B", "--hardware", "no/such.json"], "cannot read --hardware no/such.json"),
       (["plan", "--params", "1B", "--hardware", "models/gpt-tiny.json"], "is not a megakit probe profile")]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_probe_input_is_one_line_exit_2(argv, needle, capsys):
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err
