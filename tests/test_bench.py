"""Matmul timing and the machine description the lessons print."""

import pytest
import torch

from mplab import bench, hardware
from mplab._display import Table
from mplab.bench import speed


def test_matmul_speed_times_each_precision_against_the_first():
    table = bench.matmul_speed(n=64, precisions=("fp32", "bf16"), device="cpu", budget_s=0.05)
    assert table.column("precision") == ["fp32", "bf16"]
    fp32, bf16 = table.rows
    assert fp32["speed vs fp32"] == 1.0
    assert bf16["speed vs fp32"] == pytest.approx(fp32["ms per matmul"] / bf16["ms per matmul"])
    assert bf16["bytes per matrix"] * 2 == fp32["bytes per matrix"] == 64 * 64 * 4
    assert fp32["GFLOP/s"] == pytest.approx(2 * 64 ** 3 / (fp32["ms per matmul"] / 1e3) / 1e9)


def rows(speed_bf16, speed_fp16, device="cpu"):
    return Table([{"precision": f, "device": device, "speed vs fp32": s}
                  for f, s in (("fp32", 1.0), ("bf16", speed_bf16), ("fp16", speed_fp16))])


def test_the_explanation_follows_the_measurement():
    text = bench.explain_matmul_speed(rows(2.0, 0.005))
    assert "bf16 ran 2.0× faster" in text and "fp16 ran 200× SLOWER" in text
    assert "about fp32's speed" in bench.explain_matmul_speed(rows(1.0, 1.0))
    gpu = bench.explain_matmul_speed(rows(0.5, 0.5, device="cuda"))
    assert "no fast kernel" in gpu and "CPU" not in gpu


def test_bad_sizes_and_precisions_are_named():
    with pytest.raises(ValueError, match="positive int, got 0"):
        bench.time_matmul(0)
    with pytest.raises(ValueError, match="tf32 is not a storage dtype"):
        bench.time_matmul(8, "tf32")


def test_device_auto_picks_what_the_machine_has():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert hardware.resolve_device("auto").type == expected
    assert hardware.resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            hardware.resolve_device("cuda")
    with pytest.raises(ValueError, match="'tpu'.*accepted"):
        hardware.resolve_device("tpu")
    assert hardware.describe().startswith(expected)
    assert set(hardware.cpu_features()) >= {"avx512_bf16", "avx512_fp16", "amx_bf16"}


def test_one_thread_timing_restores_torchs_thread_count_and_reports_the_best_run():
    threads = torch.get_num_threads()
    t = bench.time_matmul(32, "fp32", "cpu", budget_s=0.02, threads=1)
    assert torch.get_num_threads() == threads
    assert 0 < t.best <= t.seconds and t.repeats >= 1


def test_has_units_reads_the_cpu_flags_for_each_precision(monkeypatch):
    features = hardware.cpu_features()
    monkeypatch.setattr(hardware, "cpu_features",
                        lambda: dict.fromkeys(features, False)
                        | {"amx_bf16": True})
    assert hardware.has_units("bf16") and not hardware.has_units("fp16")
    assert hardware.has_units("fp32")
    with pytest.raises(ValueError, match="'fp8'.*accepted"):
        hardware.has_units("fp8")


def test_the_environment_makes_mplab_read_the_cpu_as_another_kind(monkeypatch):
    """MPLAB_CPU_FEATURES: a kind, or flags; what the lessons and tests see as this CPU."""
    monkeypatch.setenv("MPLAB_CPU_FEATURES", "avx2")
    assert not hardware.has_units("bf16") and not hardware.has_units("fp16")
    assert not hardware.runs_fast("bf16", "cpu") and hardware.runs_fast("fp32", "cpu")
    assert "bf16 units: no, fp16 units: no" in hardware.describe("cpu")
    monkeypatch.setenv("MPLAB_CPU_FEATURES", "avx512_bf16")
    assert hardware.has_units("bf16") and not hardware.has_units("fp16")
    monkeypatch.setenv("MPLAB_CPU_FEATURES", "amx")
    assert hardware.has_units("bf16") and hardware.has_units("fp16")
    monkeypatch.setenv("MPLAB_CPU_FEATURES", " amx_fp16 , f16c ")
    assert hardware.has_units("fp16") and not hardware.has_units("bf16")
    monkeypatch.setenv("MPLAB_CPU_FEATURES", "avx512")
    with pytest.raises(ValueError, match="MPLAB_CPU_FEATURES='avx512': unknown avx512; "
                                         "accepted: a kind \\(avx2, avx512_bf16, amx\\)"):
        hardware.cpu_features()
    assert hardware.no_units_reason("fp16") == ("this CPU has no fp16 arithmetic units (no "
                                                "avx512_fp16 / amx_fp16)")


def test_training_speed_times_each_size_and_precision_through_mplab_train():
    table = bench.training_speed(sizes=({"hidden_size": 64, "num_hidden_layers": 1},),
                                 precisions=("fp32", "bf16"), device="cpu", steps=2,
                                 batch_size=4)
    fp32, bf16 = table.rows
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    assert fp32["matmuls ran in"] == "float32" and bf16["matmuls ran in"] == "bfloat16"
    assert fp32["speed vs fp32"] == 1.0
    assert bf16["speed vs fp32"] == pytest.approx(fp32["ms per step"] / bf16["ms per step"])
    assert fp32["hidden"] == 64 and fp32["parameters"] > 0
    with pytest.raises(ValueError, match="steps must be an integer >= 2"):
        bench.training_speed(steps=1)
    with pytest.raises(ValueError, match="multiple of 64, got 100"):
        bench.training_speed(sizes=({"hidden_size": 100},), steps=2)


def speeds(bf16_speed, hidden=128, device="cpu"):
    return Table([{"hidden": hidden, "layers": 2, "precision": p, "speed vs fp32": s,
                   "device": device} for p, s in (("fp32", 1.0), ("bf16", bf16_speed))])


def test_the_training_speed_explanation_names_the_units_and_the_matrix_size(monkeypatch,
                                                                            machine):
    timings = {"fp32": 4.0, "bf16": 1.0}  # the bare matmul: bf16 4x faster
    monkeypatch.setattr(speed, "time_matmul", lambda n, p, device, budget_s: bench.MatmulTiming(
        p, n, device, timings[p], 1))
    with pytest.raises(ValueError, match="empty"):
        bench.explain_training_speed(Table([]))
    if not machine.units("bf16"):
        none = bench.explain_training_speed(speeds(0.1))
        assert "10× slower" in none and "no bf16 arithmetic units" in none
        # near fp32's speed it is no "1× slower"; the reason is said once, not per size
        two = bench.explain_training_speed(Table(speeds(0.8).rows + speeds(0.7, 256).rows[1:]))
        assert "bf16 ran at 0.80× fp32's speed:" in two and "× slower" not in two
        assert "hidden 256, 2 layers: bf16 ran at 0.70× fp32's speed." in two
        assert two.count("no bf16 arithmetic units") == 1
        return
    small = bench.explain_training_speed(speeds(0.8, device=machine.device))
    assert "0.80× fp32's speed" in small and "too small (128 wide)" in small
    assert "runs 4.0× faster in bf16" in small
    assert ("tensor cores" if machine.device == "cuda" else "avx512_bf16") in small
    big = bench.explain_training_speed(speeds(1.9, hidden=512, device=machine.device))
    assert "1.9× faster" in big and "big enough" in big


def test_size_effect_speaks_of_size_only_where_the_table_timed_more_than_one(machine):
    sizes = ({"hidden_size": 64, "num_hidden_layers": 1}, {"hidden_size": 128,
                                                          "num_hidden_layers": 1})
    speeds = bench.training_speed(sizes, device="auto", steps=2, batch_size=2)
    words = bench.size_effect(speeds)
    bf16 = [r for r in speeds if r["precision"] == "bf16"]
    assert words.startswith(f"bf16 ran at {bf16[0]['speed vs fp32']:.2f}× fp32's speed at "
                            "hidden 64, 1 layers")
    if machine.device == "cpu" and not machine.cpu_bf16:
        assert len(bf16) == 1
        assert "this CPU has no bf16 arithmetic units" in words and "cannot show here" in words
    else:
        assert len(bf16) == 2 and "cannot show" not in words
        assert f"then {bf16[1]['speed vs fp32']:.2f}× fp32's speed at hidden 128" in words
        first, last = bf16[0]["speed vs fp32"], bf16[1]["speed vs fp32"]
        assert ("gained with size" in words) == (last > 1.1 * first)
    with pytest.raises(ValueError, match="bench.training_speed"):
        bench.size_effect(speeds.__class__([{"precision": "bf16"}]))


# ---- GPUs with fp16 units and no bf16 units (T4, V100), simulated by compute capability ----

GPUS = {"Tesla T4": (7, 5), "Tesla V100-SXM2-16GB": (7, 0), "NVIDIA A100-SXM4-80GB": (8, 0),
        "NVIDIA H100 80GB HBM3": (9, 0)}


@pytest.fixture(params=list(GPUS))
def gpu(request, monkeypatch):
    """This machine as if it had the named GPU: CUDA there, with its compute capability, and
    torch.cuda.is_bf16_supported() saying True on every one (as torch says with emulation)."""
    name = request.param
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: GPUS[name])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return name


def test_a_gpu_without_bf16_units_gets_fp16_with_a_scaler_and_bf16_is_refused(gpu):
    from mplab.train.errors import check_precision

    native = GPUS[gpu] >= (8, 0)
    assert hardware.cuda_units("fp16", "cuda") and hardware.runs_fast("fp16", "cuda")
    assert hardware.cuda_units("bf16", "cuda") == native == hardware.runs_fast("bf16", "cuda")
    assert hardware.cuda_units("fp8", "cuda") == (GPUS[gpu] >= (8, 9))
    precision, why = hardware.recommended_precision("cuda")
    assert precision == ("bf16" if native else "fp16") and gpu in why
    if native:
        check_precision("bf16", torch.device("cuda"))  # no error
    else:
        assert "GradScaler" in why and "emulated" in why
        with pytest.raises(ValueError, match=rf"{gpu} has no bf16 units .*'fp16' \(with a "
                                             "GradScaler"):
            check_precision("bf16", torch.device("cuda"))
    check_precision("fp16", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown precision 'fp4'; accepted: 'fp32', 'fp16'"):
        hardware.cuda_units("fp4", "cuda")


def test_on_a_cpu_the_recommendation_follows_its_bf16_units(machine):
    precision, why = hardware.recommended_precision("cpu")
    assert precision == ("bf16" if hardware.has_units("bf16") else "fp32"), why


def test_the_share_divides_the_steps_speed_up_by_one_layers_gemms():
    """training_share: the bf16/fp32 step speed through mplab.train over the bf16/fp32 speed of
    one layer's GEMMs, measured in one call (numbers vary by machine: their relations do not)."""
    from mplab.bench.__main__ import parse_args

    gemm = bench.gemm_speedup(64, 128, 64, device="cpu", repeats=2)
    assert gemm["fp32_s"] > 0 and gemm["bf16_s"] > 0
    assert gemm["speedup"] == pytest.approx(gemm["fp32_s"] / gemm["bf16_s"])
    share = bench.training_share(hidden=64, layers=1, batch_size=4, max_length=16, steps=3,
                                 rounds=3, device="cpu")
    assert len(share["rounds"]) == 3
    for r in share["rounds"]:
        assert r["step_speedup"] == pytest.approx(r["fp32_step_s"] / r["bf16_step_s"])
        assert r["share"] == pytest.approx(r["step_speedup"] / r["gemm_speedup"])
        assert 0 < r["tokens"] <= 4 * 16  # what the steps computed on, padding included
    for key in ("share", "step_speedup", "gemm_speedup"):  # the medians over the rounds
        assert share[key] == sorted(r[key] for r in share["rounds"])[1]
    assert share["attention"].startswith("math")  # bf16 on a CPU
    with pytest.raises(ValueError, match="rounds must be .* got 0"):
        bench.training_share(rounds=0)
    assert parse_args(["--share"]).share and not parse_args([]).share


def test_the_profile_puts_the_matmuls_share_and_speed_up_into_amdahls_bound():
    """step_profile: op by op, fp32 and bf16 from the same weights; the bound is Amdahl's
    from the matmuls' share and speed-up, the step's speed-up the ops' totals' ratio (the
    figures vary by machine, their relations do not)."""
    found = bench.step_profile(hidden=64, layers=1, batch_size=4, max_length=8, steps=1,
                               attention="mplab", device="cpu")
    ops = {r["op"]: r for r in found["table"]}
    assert {"mm", "addmm"} <= set(ops) and ops["mm"]["kind"] == "matmul"
    assert 0 < found["matmul_share"] < 1
    assert found["bound"] == pytest.approx(
        1 / ((1 - found["matmul_share"]) + found["matmul_share"] / found["matmul_speedup"]))
    assert found["step_speedup"] == pytest.approx(found["fp32_ms"] / found["bf16_ms"])
    assert found["attention"]["bf16"] == "math"  # mplab's choice for bf16 on a CPU
    assert not any("flash" in r["op"] and r["bf16 ms"] for r in found["table"])
    for _op, fp32, bf16 in found["slower"]:
        assert bf16 > 1.1 * fp32
    for bad, match in (({"attention": "fast"}, "attention must be one of"),
                       ({"layers": 0}, "layers must be a whole number of at least 1, got 0"),
                       ({"steps": 1.5}, "steps must be")):
        with pytest.raises(ValueError, match=match):
            bench.step_profile(**bad)
    assert bench.amdahl_bound(0.5, 2.0) == pytest.approx(4 / 3)


def test_the_profile_in_words_names_what_ate_the_speed_up(machine):
    """explain_profile's words follow the figures: the bound, what the step kept, the ops
    that got slower (the CPU flash attention's backward named as such), and a CPU without
    bf16 units where the matmuls themselves slowed down."""
    flash = "_scaled_dot_product_flash_attention_for_cpu_backward"
    found = {"matmul_share": 0.85, "matmul_speedup": 2.16, "bound": 1.84, "step_speedup": 1.52,
             "fp32_ms": 405.4, "bf16_ms": 266.4, "slower": [(flash, 12.4, 68.5)],
             "attention": {"fp32": "flash (torch's choice)", "bf16": "flash (torch's choice)"},
             "device": "cpu"}
    said = bench.explain_profile(found)
    assert "85% of the fp32 step" in said and "1.84x as fast (Amdahl's bound)" in said
    assert "83% of the bound" in said and f"{flash} 12.4 -> 68.5 ms" in said
    assert "flash attention backward" in said and "math backend" in said
    slow = bench.explain_profile(found | {"matmul_speedup": 0.04, "bound": 0.06,
                                          "step_speedup": 0.06, "slower": []})
    assert ("no bf16 arithmetic units" in slow) == (not machine.cpu_bf16)
    assert "cannot pay here" in slow and "No op got slower" in slow
    assert "at or past the bound" in bench.explain_profile(found | {"step_speedup": 1.9})


@pytest.mark.parametrize("gpu", ["A100", "H100", "none"])
def test_the_low_bit_table_agrees_with_cuda_units_and_marks_this_gpus_row(monkeypatch, gpu):
    """Each NVIDIA row says yes to FP8, MX and NVFP4 exactly where `cuda_units` does for its
    capability; the row of the GPU at hand is marked (none without a GPU)."""
    for row in hardware.LOW_BIT_HARDWARE:
        if row["capability"] is None:
            continue
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None, c=row["capability"]: c)
        for unit in ("fp8", "mx", "nvfp4"):
            assert hardware.cuda_units(unit) == (not row[unit].startswith("no")), (row, unit)
    capability = {"A100": (8, 0), "H100": (9, 0)}.get(gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    table = hardware.low_bit_table()
    marked = [r["chips"] for r in table if r["this machine"]]
    assert marked == ({"A100": ["NVIDIA Ampere (A100; compute capability 8.0)"],
                       "H100": ["NVIDIA Hopper (H100, H200, H800; 9.0)"]}.get(gpu) or [])
    assert ("no GPU" in table.note) == (gpu == "none")
