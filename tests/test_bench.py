"""Matmul timing and the machine description the lessons print."""

import pytest
import torch

from mplab import bench, hardware
from mplab._display import Table


def test_matmul_speed_times_each_format_against_the_first():
    table = bench.matmul_speed(n=64, formats=("fp32", "bf16"), device="cpu", budget_s=0.05)
    assert table.column("format") == ["fp32", "bf16"]
    fp32, bf16 = table.rows
    assert fp32["speed vs fp32"] == 1.0
    assert bf16["speed vs fp32"] == pytest.approx(fp32["ms per matmul"] / bf16["ms per matmul"])
    assert bf16["bytes per matrix"] * 2 == fp32["bytes per matrix"] == 64 * 64 * 4
    assert fp32["GFLOP/s"] == pytest.approx(2 * 64 ** 3 / (fp32["ms per matmul"] / 1e3) / 1e9)


def rows(speed_bf16, speed_fp16, device="cpu"):
    return Table([{"format": f, "device": device, "speed vs fp32": s}
                  for f, s in (("fp32", 1.0), ("bf16", speed_bf16), ("fp16", speed_fp16))])


def test_the_explanation_follows_the_measurement():
    text = bench.explain_matmul_speed(rows(2.0, 0.005))
    assert "bf16 ran 2.0× faster" in text and "fp16 ran 200× SLOWER" in text
    assert "about fp32's speed" in bench.explain_matmul_speed(rows(1.0, 1.0))
    gpu = bench.explain_matmul_speed(rows(0.5, 0.5, device="cuda"))
    assert "no fast kernel" in gpu and "CPU" not in gpu


def test_bad_sizes_and_formats_are_named():
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
