"""python -m mplab.bench: the CLI and its JSON, the crossover and the explanations on rows
whose measurements are given, the utilisation formula and the datasheet table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mplab.bench import peaks, why
from mplab.bench.sweep import (
    BenchRow,
    CpuMemoryProbe,
    Plan,
    matmul_sweep,
    model_sweep,
    peak_live_bytes,
)

REPO = Path(__file__).resolve().parents[1]
ROW_KEYS = {"workload", "precision", "throughput", "speedup_vs_fp32", "peak_memory_bytes", "mfu"}


def test_the_cli_measures_every_precision_and_writes_json_and_a_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = subprocess.run([sys.executable, "-m", "mplab.bench", "--tiny", "--device", "cpu",
                           "--json", str(out), "--plot", str(png)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu") and report["rows"]
    for row in report["rows"]:
        assert ROW_KEYS <= set(row), row
        assert row["throughput"] > 0 and row["peak_memory_bytes"] > 0
    kinds = {(r["kind"], r["precision"]) for r in report["rows"]}
    assert {("matmul", p) for p in ("fp32", "bf16", "fp16")} <= kinds
    assert {("model", p) for p in ("fp32", "bf16", "fp16")} <= kinds
    assert {r["n"] for r in report["rows"] if r["kind"] == "matmul"} == {31, 32}
    fp32 = [r for r in report["rows"] if r["precision"] == "fp32"]
    assert all(r["speedup_vs_fp32"] == 1.0 for r in fp32)
    model = next(r for r in report["rows"] if r["kind"] == "model" and r["precision"] == "bf16")
    assert model["loss_change"] is not None
    # MFU against the fastest matmul this run measured; --tiny's are 31 and 32 wide, which a
    # model step's larger matmuls may outrun (seen with bf16 units): then it says so instead
    if model["mfu"] is None:
        assert model["mfu_reference"].startswith("no MFU: the step ran its matmuls faster")
    else:
        assert 0 < model["mfu"] <= 1
    assert model["matmuls_ran_in"] == "bfloat16"
    assert png.read_bytes()[:4] == b"\x89PNG"
    for words in ("Why:", "crossover", "Targets:", "6 × (parameters in matmuls) × tokens"):
        assert words in done.stdout
    # the meta a reference file needs: when, where, with what, and how it was run
    meta = report["meta"]
    assert meta["command"] == (f"python -m mplab.bench --tiny --device cpu --json {out} "
                               f"--plot {png}")
    assert meta["preset"] == "tiny" and meta["device"] == report["device"]
    assert meta["torch"] == torch.__version__ and meta["python"].count(".") == 2
    assert meta["transformers"] and meta["date"][:2] == "20" and meta["gpu"] is None
    assert report["preset"] == "tiny" and report["crossover"] and report["targets"]


def test_bad_cli_input_names_what_was_given_and_what_is_accepted(tmp_path, capsys):
    from mplab.bench.__main__ import parse_args

    def refused(*args) -> str:
        with pytest.raises(SystemExit) as exit:  # argparse's error(): usage, message, 2
            parse_args(list(args))
        assert exit.value.code == 2
        return capsys.readouterr().err

    said = refused("--device", "tpu")
    assert "'tpu'" in said and "auto, cpu, cuda" in said
    assert "does not exist" in refused("--json", str(tmp_path / "missing" / "x.json"))


def test_the_cli_and_lesson_bench_write_one_record(tmp_path):
    from mplab import bench
    from mplab.bench.__main__ import parse_args, run

    out = tmp_path / "bench.json"
    printed = run(parse_args(["--tiny", "--lesson", "--device", "cpu", "--json", str(out)]))
    written = json.loads(out.read_text())
    assert written == printed
    lesson = bench.lesson_bench("cpu", tiny=True)
    assert set(lesson) == set(written) and set(lesson["meta"]) == set(written["meta"])
    assert [(r["workload"], r["precision"]) for r in lesson["rows"]] == \
        [(r["workload"], r["precision"]) for r in written["rows"]]
    assert all(set(a) == set(b) for a, b in zip(lesson["rows"], written["rows"]))


def model_row(hidden, precision, speedup, *, mfu=None, memory=100, params=None, units=True):
    """A model row as the sweep measures it; `units`: the CPU had units for the precision."""
    return BenchRow(f"train hidden {hidden}", "model", precision, 10.0 * speedup, "samples/s",
                    speedup, memory, "test", mfu=mfu, hidden=hidden, layers=2,
                    parameters=params or hidden ** 2, loss_change=0.001, has_units=units)


def matmul_row(n, precision, speedup, gflops=100.0, units=True):
    return BenchRow(f"matmul {n}×{n}", "matmul", precision, gflops, "GFLOP/s", speedup,
                    3 * n * n * 4, "test", n=n, has_units=units)


def sweep(bf16_speedups, fp32_mfus=(0.1, 0.3, 0.6), units=True):
    rows = [matmul_row(1024, "fp32", 1.0), matmul_row(1024, "bf16", 4.0, units=units)]
    for hidden, s, m in zip((128, 256, 512), bf16_speedups, fp32_mfus):
        rows += [model_row(hidden, "fp32", 1.0, mfu=m, memory=100),
                 model_row(hidden, "bf16", s, memory=90, units=units)]
    return rows


def test_the_crossover_is_the_smallest_size_that_beats_fp32_and_says_why():
    found = why.crossover(sweep((0.8, 1.05, 1.9)), "bf16", "cpu")
    assert found["workload"] == "train hidden 512" and found["speedup"] == 1.9
    text = found["text"]
    assert "crossover is hidden 512/2 layers" in text
    assert "at hidden 256/2 layers it ran 1.05×" in text
    assert "hidden 128/2 layers: 10%" in text and "hidden 512/2 layers: 60%" in text
    # Amdahl's law with the bare matmul's 4x: 1 / (0.4 + 0.6 / 4) = 1.82
    assert "hidden 512/2 layers: 1.82×" in text and "bare 1024² matmul 4.0×" in text
    assert why.crossover(sweep((1.5, 1.6, 1.9)), "bf16", "cpu")["text"].startswith(
        "bf16: it pays already at the smallest size")
    none = why.crossover(sweep((0.8, 0.9, 1.0)), "bf16", "cpu")
    assert none["workload"] is None and "no crossover up to hidden 512/2 layers" in none["text"]


def test_a_cpu_without_units_has_no_crossover_and_the_rows_say_why():
    rows = [model_row(128, "fp32", 1.0, mfu=0.2),
            model_row(128, "fp16", 0.02, memory=130, units=False)]
    found = why.crossover(rows, "fp16", "cpu")
    assert found["workload"] is None and "no fp16 units" in found["text"]
    text = why.explain_row(rows[1], rows, "cpu")
    assert "50× slower than fp32" in text and "avx512_fp16 / amx_fp16" in text
    assert "too small to pay" not in text  # the missing units, not the size, are the reason
    assert "peak memory 1.30× fp32's" in text and "MORE than fp32's" in text
    assert "two precisions" in text and "+0.10%" in text


def test_the_explanations_follow_the_measurements():
    rows = [matmul_row(255, "fp32", 1.0, 80), matmul_row(256, "fp32", 1.0, 100),
            matmul_row(255, "bf16", 1.0, 80), matmul_row(256, "bf16", 1.05, 105),
            matmul_row(1024, "fp32", 1.0), matmul_row(1024, "bf16", 3.5, 350)]
    ragged = why.explain_row(rows[2], rows, "cpu")
    assert "255 is not a multiple of 8: 80 GFLOP/s against 105 at 256 (0.76×)" in ragged
    assert "too small to keep the units busy" in ragged and "1024² runs 3.5×" in ragged
    assert "tensor cores" in why.explain_row(rows[2], rows, "cuda")
    assert "3.5× fp32: half the bytes" in why.explain_row(rows[5], rows, "cpu")
    small = sweep((0.8, 1.05, 1.9))
    slow = why.explain_row(small[3], small, "cpu")
    assert "0.80× fp32" in slow and "too small to pay" in slow and "10% of the matmul peak" in slow
    assert "memory-bound ops" in slow and "0.90× fp32's" in slow and "not the 0.5×" in slow
    fast = why.explain_row(small[7], small, "cpu")
    assert "1.9× fp32" in fast and "keep the bf16 units busy" in fast


def test_the_multiple_of_8_words_follow_the_pair_measured_and_the_units():
    def pair(ragged, aligned, precision="bf16", units=True):
        rows = [matmul_row(255, precision, 1.0, ragged, units),
                matmul_row(256, precision, 1.0, aligned, units)]
        return why.explain_row(rows[0], rows, "cpu"), why.explain_row(rows[1], rows, "cpu")

    slower, aligned = pair(80, 100)
    assert "255 is not a multiple of 8: 80 GFLOP/s against 100 at 256 (0.80×)" in slower
    assert "tail loop" in slower and "multiple of 8" not in aligned
    same, _ = pair(98, 100)
    assert "yet it ran about as fast as 256" in same and "too small a share" in same
    # faster at 255 with units: said as measured, against the rule, never as the rule
    faster, _ = pair(150, 100)
    assert "yet it ran faster than 256: 150 GFLOP/s against 100 at 256 (1.50×)" in faster
    assert "against the multiple-of-8 rule" in faster and "tail loop" not in faster
    # without units for the precision (a CPU converting every element) the rule need not hold
    emulated, _ = pair(2.9, 1.3, units=False)
    assert "yet it ran faster than 256: 2.9 GFLOP/s against 1.3 at 256 (2.23×)" in emulated
    assert "none for bf16, so it need not hold here" in emulated
    assert "does not explain it" in pair(1.0, 1.3, "fp16", units=False)[0]


def test_targets_print_the_measured_figure_and_whether_it_was_met():
    assert "measured 1.90× (met)" in why.targets(sweep((0.8, 1.05, 1.9)), "cpu")[0]
    assert "measured 1.50× (NOT met)" in why.targets(sweep((0.8, 1.05, 1.5)), "cpu")[0]
    gpu = [model_row(1024, "fp32", 1.0, params=150_000_000),
           model_row(1024, "bf16", 3.2, mfu=0.45, params=150_000_000)]
    assert "3.20×, MFU 45% (met)" in why.targets(gpu, "cuda")[0]
    gpu[1].mfu = None
    line = why.targets(gpu, "cuda")[0]
    assert "not in the datasheet table" in line and "NOT met" in line
    assert "has none" in why.targets(sweep((0.1, 0.1, 0.1), units=False), "cpu")[0]


def test_training_flops_are_six_per_weight_and_token_plus_attention():
    # 1M matmul weights, batch 8 × 64 tokens, 2 layers of hidden 128
    tokens = 8 * 64
    expected = 6 * 1_000_000 * tokens + 12 * 2 * 128 * 64 * tokens
    assert peaks.training_flops(1_000_000, tokens, 2, 128, 64) == expected
    assert peaks.mfu(expected, 0.5, expected * 4) == pytest.approx(0.5)
    assert peaks.mfu(expected, 0.5, None) is None
    with pytest.raises(ValueError, match="tokens must be an integer >= 0, got -1"):
        peaks.training_flops(10, -1, 1, 64, 8)


def test_matmul_parameters_count_linear_weights_only():
    from mplab.models import lesson_model

    model = lesson_model(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=128)
    # per layer: q, k, v, attention output (64×64 each), feed-forward 64×128 and back; the
    # pooler 64×64 and the classifier 64×2; embeddings are lookups and count nothing
    assert peaks.matmul_parameters(model) == 4 * 64 * 64 + 2 * 64 * 128 + 64 * 64 + 64 * 2


def test_the_datasheet_table_knows_hopper_and_ampere_and_says_when_it_does_not():
    assert peaks.datasheet_gpu("NVIDIA H200") == "H200 SXM"
    assert peaks.datasheet_gpu("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert peaks.datasheet_gpu("NVIDIA H100 PCIe") == "H100 PCIe"
    assert peaks.datasheet_gpu("NVIDIA A100-SXM4-80GB") == "A100"
    assert peaks.datasheet_gpu("NVIDIA H100 NVL") is None
    assert peaks.datasheet_gpu("NVIDIA GeForce RTX 4090") is None
    assert peaks.datasheet_peak("NVIDIA H200", "bf16") == 989e12
    assert peaks.datasheet_peak("NVIDIA H200", "tf32") == 494e12
    assert peaks.datasheet_peak("NVIDIA H200", "fp32") == 67e12
    assert peaks.datasheet_peak("NVIDIA A100 80GB PCIe", "fp16") == 312e12
    assert peaks.datasheet_peak("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12
    assert peaks.datasheet_peak("Tesla T4", "bf16") is None
    with pytest.raises(ValueError, match="'fp8'.*accepted"):
        peaks.datasheet_peak("NVIDIA H200", "fp8")


def test_the_cpu_memory_probe_finds_the_highest_running_total():
    changes = [(3, -80), (1, 100), (2, 80), (4, 60), (5, 0)]
    assert peak_live_bytes(changes) == 180  # in time order: 100, 180, 100, 160
    # a free of a block the profile never saw allocated (an earlier profiler's) is not the
    # step's: it does not lower the peak
    assert peak_live_bytes([(1, -4096), (2, 100), (3, 80)]) == 180


def test_the_cpu_memory_probe_counts_each_allocation_once_however_deep_the_op():
    before = torch.ones(1)  # allocated before the probe starts: its free is not reported
    probe = CpuMemoryProbe(torch.nn.Linear(256, 256, bias=False))  # resident: 256 KiB
    # linear -> matmul -> mm: its 512 KiB output is allocated inside nested ops; counted once
    # per op, it would stay "alive" after its one free below and raise the peak
    x, w = torch.randn(512, 256), torch.randn(256, 256)
    y = torch.nn.functional.linear(x, w)
    del x, w, y, before
    a = torch.empty(2**20, dtype=torch.uint8)
    b = torch.empty(2 * 2**20, dtype=torch.uint8)
    del a
    c = torch.empty(2**19, dtype=torch.uint8)
    probe.on_step(1, None)
    # a and b, alive together, exactly: the frees of tensors allocated under an earlier
    # profiler (another test's) are left out
    assert probe.peak_bytes == 256 * 256 * 4 + 3 * 2**20  # counted once per nested op: +1.8 MiB
    del b, c


def test_the_gpu_preset_adds_tf32_and_a_model_that_fills_the_device():
    plan = Plan.preset("cuda")
    assert plan.precisions == ("fp32", "tf32", "bf16", "fp16")
    assert any(n % 8 for n in plan.matmul_sizes) and max(plan.matmul_sizes) >= 4096
    hidden, layers = plan.big_model
    # per layer: q, k, v, output (h×h) and a 4h feed-forward in and out: 12 h² weights
    assert layers * 12 * hidden ** 2 >= 100_000_000
    cpu = Plan.preset("cpu", quick=True)
    assert cpu.big_model is None and {255, 256} <= set(cpu.matmul_sizes)
    assert cpu.model_sizes[0] == (128, 2) and cpu.model_sizes[-1] == (512, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_measure_tf32_and_claim_mfu_only_for_known_gpus():
    plan = Plan.preset("cuda", tiny=True)
    matmuls = matmul_sweep(plan)
    assert {r.precision for r in matmuls} == {"fp32", "tf32", "bf16", "fp16"}
    rows = matmuls + model_sweep(plan)
    known = peaks.datasheet_gpu(torch.cuda.get_device_name()) is not None
    for r in rows:
        assert r.peak_memory_bytes > 0 and r.memory_kind == "cuda max_memory_allocated" \
            or r.kind == "model"
        if r.kind == "model":
            assert (r.mfu is not None) == known and 0 < (r.mfu or 0.5) < 1


def test_a_cpu_measures_utilisation_against_a_peak_it_has(machine):
    """Against the best matmul in the precision where the CPU has units for it; else against
    fp32's, the fastest it computes, and the reference says so."""
    from mplab.bench.sweep import cpu_peak

    best = {"fp32": 50.0, "bf16": 20.0, "fp16": 2.0}
    for precision in ("fp32", "bf16", "fp16"):
        peak, said = cpu_peak(precision, best)
        against = precision if machine.units(precision) else "fp32"
        assert peak == best[against] * 1e9 and f"the fastest {against} matmul run" in said
        assert (f"no {precision} units here" in said) == (not machine.units(precision))
    assert cpu_peak("bf16", {})[0] is None


@pytest.mark.slow  # the tests' bench plan, on each machine (benchmarks/RECORDS.md)
def test_no_row_claims_more_than_100_percent_utilisation(machine):
    from mplab import bench

    record = bench.lesson_bench(machine.device, tiny=True)
    models = [r for r in record["rows"] if r["kind"] == "model"]
    cpu = machine.device == "cpu"
    assert all(r["has_units"] == (machine.units(r["precision"]) if cpu else None)
               for r in record["rows"])
    for r in models:
        assert r["mfu"] is None or 0 < r["mfu"] <= 1, r
        assert r["mfu"] is not None or "no MFU" in r["mfu_reference"], r
        if r["has_units"] is False:
            assert "fp32 is this CPU's peak" in r["mfu_reference"], r
