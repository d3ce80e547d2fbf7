"""Lesson 7's bench: `lesson_bench`'s record (what --json writes), its figure, and reference
results (data/reference/*.json) read, checked and set beside the learner's own run. Every
reference here is a real tiny bench run written by the test, never a typed-in figure."""

import copy
import json

import pytest
import torch

from mplab import bench
from mplab.bench import reference, sweep

ROW_KEYS = {"workload", "kind", "precision", "throughput", "unit", "speedup_vs_fp32",
            "peak_memory_bytes", "mfu", "explanation", "parameters", "batch_size"}
META_KEYS = {"date", "device", "gpu", "host", "python", "torch", "transformers", "command",
             "preset", "quick", "steps", "batch_size"}


@pytest.fixture(scope="module")
def record():
    """One real tiny lesson bench run on the CPU (seconds), shared by the tests below."""
    seen = []
    result = bench.lesson_bench("cpu", progress=seen.append, tiny=True)
    result["_progress"] = seen
    return result


@pytest.fixture
def mine(record):
    return {k: copy.deepcopy(v) for k, v in record.items() if k != "_progress"}


def test_the_lesson_preset_shows_the_multiple_of_8_and_the_crossover_sizes():
    plan = sweep.Plan.preset("cpu", lesson=True)
    assert plan.name == "lesson" and plan.big_model is None
    assert {255, 256} <= set(plan.matmul_sizes)  # one not a multiple of 8, one that is
    assert plan.model_sizes == ((128, 2), (256, 4), (512, 4))
    assert plan.precisions == ("fp32", "bf16", "fp16")
    # a precision without units runs at the smallest model size and the cheap matmuls only
    assert plan.slow_model_sizes == 1 and plan.slow_matmul_limit <= 256
    assert plan.steps < sweep.Plan.preset("cpu", quick=True).steps
    gpu = sweep.Plan.preset("cuda", lesson=True)
    assert gpu.precisions == ("fp32", "tf32", "bf16", "fp16") and gpu.big_model is None
    assert gpu.model_sizes == plan.model_sizes and any(n % 8 for n in gpu.matmul_sizes)
    # a GPU reference run (--quick) measures every lesson size, so their rows can match
    assert set(plan.model_sizes) <= set(sweep.Plan.preset("cuda", quick=True).model_sizes)


def test_lesson_bench_returns_the_json_record_with_rows_explanations_and_meta(record, mine):
    assert json.loads(json.dumps(mine)) == mine  # plain JSON data, as --json writes it
    assert mine["device"].startswith("cpu") and mine["preset"] == "tiny"
    rows = mine["rows"]
    assert [r.workload for r in record["_progress"]] == [r["workload"] for r in rows]
    for row in rows:
        assert ROW_KEYS <= set(row), row
        assert row["throughput"] > 0 and row["peak_memory_bytes"] > 0
    assert {(r["kind"], r["precision"]) for r in rows} >= {
        (kind, p) for kind in ("matmul", "model") for p in ("fp32", "bf16")}
    assert all(r["speedup_vs_fp32"] == 1.0 for r in rows if r["precision"] == "fp32")
    bf16 = [r for r in rows if r["precision"] == "bf16"]
    assert all(r["explanation"] for r in bf16)
    assert all(r["batch_size"] == 4 for r in rows if r["kind"] == "model")
    assert [c["precision"] for c in mine["crossover"]][0] == "bf16"
    assert "bf16" in mine["crossover"][0]["text"] and mine["targets"]
    meta = mine["meta"]
    assert META_KEYS <= set(meta)
    assert meta["preset"] == "tiny" and meta["torch"] == torch.__version__
    assert meta["command"] == "mplab.bench.lesson_bench(device='cpu', tiny=True)"
    assert meta["date"][:4].isdigit() and meta["gpu"] is None


def test_a_cpu_without_bf16_units_runs_bf16_only_where_it_is_cheap(monkeypatch):
    monkeypatch.setenv("MPLAB_CPU_FEATURES", "avx2")  # as an AVX2-only CPU reports itself
    result = bench.lesson_bench("cpu", tiny=True)
    models = [r for r in result["rows"] if r["kind"] == "model"]
    smallest = min(r["parameters"] for r in models)
    assert {r["parameters"] for r in models if r["precision"] == "bf16"} == {smallest}
    assert any("in bf16: skipped (no bf16 units here" in note for note in result["skipped"])


def test_the_figure_draws_from_the_record_and_from_json_rows(record, mine, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(mine))
    rows = json.loads(path.read_text())["rows"]
    for given in (rows, mine, [sweep.BenchRow(**r) for r in rows]):
        fig = bench.bench_plot(given)
        speed, memory = fig.axes
        # the 1× line (fp32), then each low precision's speed-ups, smallest model first
        one = speed.lines[0]
        assert list(one.get_ydata()) == [1.0, 1.0] and one.get_label() == "fp32 (1×)"
        drawn = drawn_speedups(speed)
        assert set(drawn) == {"bf16", "fp16"}
        bf16 = sorted((r for r in rows if r["kind"] == "model" and r["precision"] == "bf16"),
                      key=lambda r: r["parameters"])
        assert drawn["bf16"] == [r["speedup_vs_fp32"] for r in bf16]
        assert {line.get_label() for line in memory.lines} == {"fp32", "bf16", "fp16"}
        assert not overlapping_labels(fig)
        assert "speed-up" in speed.get_ylabel() and "memory" in memory.get_ylabel()
    assert fig.get_suptitle() == ""  # rows alone carry no device; a record does
    assert bench.bench_plot(mine).get_suptitle() == bench.machine_name(mine["device"])
    with pytest.raises(ValueError, match="model rows"):
        bench.bench_plot([r for r in rows if r["kind"] == "matmul"])


def drawn_speedups(ax) -> dict[str, list[float]]:
    """{precision: the speed-ups the panel draws}: a curve's points, or a bar's height."""
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.lines[1:]}
    drawn.update({bars.get_label(): [b.get_height() for b in bars] for bars in ax.containers})
    return drawn


def overlapping_labels(fig) -> list[tuple[str, str]]:
    """Pairs of texts (point and bar labels, tick labels) drawn over each other on one axes."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        texts = [t for t in [*ax.texts, *ax.get_xticklabels()] if t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in texts]
        found += [(texts[i].get_text(), texts[j].get_text())
                  for i in range(len(texts)) for j in range(i + 1, len(texts))
                  if boxes[i].overlaps(boxes[j])]
    return found


def model_rows(sizes, precision, speedups):
    """Model rows as the sweep writes them, at (hidden, layers, parameters) sizes."""
    return [sweep.BenchRow(f"train hidden {h}, {n} layers", "model", precision, 100 * s,
                           "samples/s", s, (p // 1000) * 2**20, "test", hidden=h, layers=n,
                           parameters=p) for (h, n, p), s in zip(sizes, speedups)]


SIZES = ((128, 2, 320_000), (256, 4, 2_300_000), (512, 4, 8_800_000))


def test_one_timed_size_draws_a_bar_per_precision_with_its_value_and_its_size():
    # a CPU without bf16/fp16 units: both timed at the lesson size only, close to each other
    rows = (model_rows(SIZES, "fp32", (1, 1, 1)) + model_rows(SIZES[:1], "bf16", (0.12,))
            + model_rows(SIZES[:1], "fp16", (0.11,)))
    fig = bench.bench_plot(rows)
    speed, memory = fig.axes
    assert drawn_speedups(speed) == {"bf16": [0.12], "fp16": [0.11]}
    assert len(speed.lines) == 1  # the 1× line; no one-point curves
    assert [t.get_text() for t in speed.texts] == ["0.12×", "0.11×"]
    ticks = [t.get_text() for t in speed.get_xticklabels()]
    assert ticks == ["bf16\nhidden 128, 2 layers", "fp16\nhidden 128, 2 layers"]
    assert "hidden 128, 2 layers" in speed.get_title() and "bf16 and fp16" in speed.get_title()
    assert [t.get_text() for t in memory.get_xticklabels()] == ["0.32\n128/2", "2.3\n256/4",
                                                                "8.8\n512/4"]
    assert not overlapping_labels(fig)


def test_several_timed_sizes_draw_curves_over_sizes_named_under_their_ticks():
    # bf16 at every size, fp16 at the smallest only (a CPU with bf16 units and no fp16 ones)
    rows = (model_rows(SIZES, "fp32", (1, 1, 1)) + model_rows(SIZES, "bf16", (0.7, 1.4, 2.1))
            + model_rows(SIZES[:1], "fp16", (0.68,)))
    fig = bench.bench_plot(rows)
    speed, _ = fig.axes
    curves = {line.get_label(): line for line in speed.lines[1:]}
    assert list(curves["bf16"].get_xdata()) == [p / 1e6 for _, _, p in SIZES]
    assert list(curves["fp16"].get_ydata()) == [0.68] and not speed.containers
    ticks = [t.get_text() for t in speed.get_xticklabels()]
    assert ticks == ["0.32\n128/2", "2.3\n256/4", "8.8\n512/4"]
    assert "vs model size" in speed.get_title()
    assert not overlapping_labels(fig)


def write(folder, name, value):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(value if isinstance(value, str) else json.dumps(value))
    return folder / name


def test_reference_results_read_every_json_file_of_a_folder(mine, tmp_path):
    folder = tmp_path / "reference"
    write(folder, "README.md", "how to add one")
    write(folder, "bench_b.json", mine)
    write(folder, "bench_a.json", mine)
    found = bench.reference_results(folder)
    assert [r["file"] for r in found] == [str(folder / "bench_a.json"),
                                         str(folder / "bench_b.json")]
    assert all({k: v for k, v in r.items() if k != "file"} == mine for r in found)
    assert bench.reference_results(tmp_path) == []  # a folder without .json files
    with pytest.raises(ValueError, match="'.*nowhere' does not exist"):
        bench.reference_results(tmp_path / "nowhere")


def test_every_committed_reference_is_a_bench_record_with_meta():
    assert reference.REFERENCE_DIR.name == "reference"
    assert (reference.REFERENCE_DIR / "README.md").is_file()
    for found in bench.reference_results():
        assert found["meta"]["command"] and found["rows"]


def test_a_broken_reference_file_is_named_with_what_is_wrong(mine, tmp_path):
    bad = write(tmp_path / "a", "bench_x.json", '{"rows": [1, 2,')
    with pytest.raises(ValueError, match=rf"{bad}.*not valid JSON.*line 1, column \d+"):
        bench.reference_results(bad.parent)
    no_meta = write(tmp_path / "b", "bench_y.json", {k: v for k, v in mine.items()
                                                     if k != "meta"})
    with pytest.raises(ValueError, match=rf"{no_meta}.*no \"meta\".*--json FILE"):
        bench.reference_results(no_meta.parent)
    rows = copy.deepcopy(mine)
    del rows["rows"][1]["speedup_vs_fp32"]
    lacks = write(tmp_path / "c", "bench_z.json", rows)
    with pytest.raises(ValueError, match=rf"{lacks}.*rows\[1\] lacks 'speedup_vs_fp32'"):
        bench.reference_results(lacks.parent)
    listed = write(tmp_path / "d", "bench_w.json", [mine])
    with pytest.raises(ValueError, match=rf"{listed}.*JSON list, not an object"):
        bench.reference_results(listed.parent)


def test_the_comparison_sets_each_reference_row_beside_yours_by_workload(mine):
    theirs = copy.deepcopy(mine)
    theirs["meta"]["date"] = "2001-02-03T04:05:06+00:00"
    # the reference ran other model sizes: those of your rows have no twin there
    for r in theirs["rows"]:
        if r["kind"] == "model":
            r["workload"] = r["workload"].replace("train hidden", "train wider")
    label = reference.reference_label(theirs)
    assert label.endswith(", 2001-02-03")
    table = bench.compare_with_reference(mine, [mine, theirs])
    assert len(table) == len(mine["rows"])
    assert "2 reference runs" in table.title
    matmuls = sum(r["kind"] == "matmul" for r in mine["rows"])
    assert f"{len(mine['rows'])} of {len(mine['rows'])} rows matched" in table.title
    same = reference.reference_label(mine)
    for line, r in zip(table, mine["rows"]):
        assert (line["workload"], line["precision"]) == (r["workload"], r["precision"])
        assert line["your vs fp32"] == round(r["speedup_vs_fp32"], 2)
        assert line[f"{same}: vs fp32"] == line["your vs fp32"]
        assert line[f"{same}: throughput"] == round(r["throughput"], 1)
        other = line[f"{label}: vs fp32"]
        assert (other == "-") == (r["kind"] == "model"), line
    only_theirs = bench.compare_with_reference(mine, [theirs])
    assert f"{matmuls} of {len(mine['rows'])} rows matched" in only_theirs.title
    text = bench.explain_reference(mine, [theirs])
    assert label in text and f"{matmuls} of your {len(mine['rows'])} rows have a twin" in text
    both = bench.explain_reference(mine, [mine])
    assert "bf16 ran" in both and "here and" in both and "batch 4 here and 4 there" in both


def test_with_no_reference_the_table_is_yours_and_the_sentence_says_none_was_measured(mine):
    table = bench.compare_with_reference(mine, [])
    assert table.columns == ["workload", "precision", "unit", "your vs fp32",
                             "your throughput", "your MFU"]
    assert "no reference run recorded" in table.title
    text = bench.explain_reference(mine, [])
    assert "No reference GPU run has been recorded yet" in text
    assert "no figure for hardware nobody measured" in text
    assert "benchmarks/gpu_check.sh" in text
    with pytest.raises(ValueError, match="references\\[0\\].*no \"meta\""):
        bench.compare_with_reference(mine, [{"rows": mine["rows"]}])
    with pytest.raises(ValueError, match="mine must be a bench record"):
        bench.compare_with_reference(mine["rows"], [])


def test_a_reference_file_is_named_by_its_device_and_date(mine):
    name = bench.reference_filename(mine)
    assert name.startswith("bench_cpu-") and name.endswith(f"_{mine['meta']['date'][:10]}.json")
    gpu = copy.deepcopy(mine)
    gpu["meta"]["gpu"] = "NVIDIA H200"
    assert bench.reference_filename(gpu) == f"bench_nvidia-h200_{mine['meta']['date'][:10]}.json"
    assert reference.reference_label(gpu).startswith("NVIDIA H200, ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_lesson_bench_measures_tf32_and_names_the_gpu_in_its_meta():
    result = bench.lesson_bench("cuda", tiny=True)
    assert {r["precision"] for r in result["rows"]} == {"fp32", "tf32", "bf16", "fp16"}
    assert result["meta"]["gpu"] == torch.cuda.get_device_name()
    assert bench.reference_filename(result).startswith("bench_")
