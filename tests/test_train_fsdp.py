"""Lesson 8's machinery on real processes (torchrun, gloo): the FSDP2 path against the one-process
torch path, the dtypes each collective really ran in, DDP's compress hooks, the scalers when
one rank alone overflows, and the planner against the bytes each rank really holds."""

import os
import statistics
from pathlib import Path

import pytest
import torch

from mplab.exercises import lesson8
from mplab.train import TrainConfig, plan, train
from mplab.train.launch import run_across, train_across

QUICK = dict(model="lesson-pretrained", warmup_steps=0, eval_samples=64, progress=False)
STEPS = 20


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """One start of 2 processes for every job."""
    tmp = tmp_path_factory.mktemp("trainer")
    jobs = {"fsdp_bf16": dict(path="fsdp", precision="bf16", batch_size=8),
            "fsdp_fp16": dict(path="fsdp", precision="fp16", batch_size=8, init_scale=2.0**10,
                              max_grad_norm=1.0),
            "fsdp_fp16_mplab": dict(path="fsdp", precision="fp16", batch_size=8,
                                    init_scale=2.0**10, scaler="mplab", max_grad_norm=1.0),
            "fsdp_bf16_reduce": dict(path="fsdp", precision="bf16", batch_size=8,
                                     reduce_dtype="bf16", steps=2),
            "ddp_fp32": dict(path="torch", precision="fp32", batch_size=8),
            "ddp_bf16_hook": dict(path="torch", precision="fp32", batch_size=8,
                                  comm_hook="bf16"),
            "bad": dict(path="fsdp", reduce_dtype="fp8"),
            "fsdp_fp32": dict(path="fsdp", precision="fp32", batch_size=8, steps=5),
            **{f"mystery_{k}": job for k, job in lesson8.MYSTERY_JOBS.items()}}
    trains = [("mplab.train:train", {"steps": STEPS, **QUICK, **job}) for job in jobs.values()]
    others = {f"overflow_{s}": ("mplab.train.ranks:overflow_on_one_rank", {"scaler": s})
              for s in ("torch", "sharded", "mplab", "mplab_alone")}
    others["libraries"] = ("mplab.train.libraries:both", {"output_dir": str(tmp)})
    results = run_across(2, None, trains + list(others.values()))
    return dict(zip([*jobs, *others], results))


def _mean10(result):
    return statistics.mean(result.losses[-10:])


def _traffic(result, rank=0):
    return {(row["op"], row["dtype"]): row for row in result.ranks[rank]["collectives"]}


def test_fsdp_on_two_processes_trains_as_the_torch_path_in_one(two):
    alone = train(path="torch", precision="bf16", steps=STEPS, batch_size=16, **QUICK)
    fsdp = two["fsdp_bf16"]
    assert fsdp.world_size == 2 and fsdp.global_batch_size == alone.global_batch_size
    assert abs(_mean10(fsdp) - _mean10(alone)) / _mean10(alone) < 0.01
    assert abs(fsdp.losses[-1] - alone.losses[-1]) / alone.losses[-1] < 0.05
    assert fsdp.compute_dtype == torch.bfloat16 and fsdp.param_dtype == torch.float32
    assert fsdp.eval_accuracy is not None


def test_each_rank_holds_its_shard_and_the_collectives_run_in_the_policys_dtypes(two):
    fsdp, reduced = two["fsdp_bf16"], two["fsdp_bf16_reduce"]
    assert [r["rank"] for r in fsdp.ranks] == [0, 1]
    for name_shards in zip(*(r["shards"] for r in fsdp.ranks)):
        (first, second) = name_shards
        assert first["name"] == second["name"] and first["dtype"] == "float32"
        assert first["local_shape"][0] + second["local_shape"][0] == first["shape"][0]
    assert set(_traffic(fsdp)) == {("all_gather", "bfloat16"), ("reduce_scatter", "float32")}
    assert set(_traffic(reduced)) == {("all_gather", "bfloat16"), ("reduce_scatter", "bfloat16")}
    # the reduce-scatter hands in the whole gradients: half the bytes in bf16
    assert _traffic(reduced)["reduce_scatter", "bfloat16"]["bytes"] * 2 == \
        _traffic(fsdp)["reduce_scatter", "float32"]["bytes"]
    # forward gathers every unit once, backward every block again: more calls than units
    gathers = _traffic(fsdp)["all_gather", "bfloat16"]["calls"]
    assert gathers > _traffic(fsdp)["reduce_scatter", "float32"]["calls"]


def test_the_audit_across_ranks_reads_each_ranks_shard_and_dtypes(two):
    from mplab.train.ranks import ranks_table

    rows = ranks_table(two["fsdp_bf16_reduce"].ranks).rows
    assert [r["rank"] for r in rows] == [0, 1]
    shares = [float(r["share of the weights"].rstrip("%")) for r in rows]
    assert sum(shares) == pytest.approx(100, abs=0.1) and all(40 < s < 60 for s in shares)
    assert {(r["stored"], r["all-gathered in"], r["reduced in"], r["gradients"],
             r["optimizer states"]) for r in rows} == {
        ("float32", "bfloat16", "bfloat16", "float32", "float32")}
    ddp = ranks_table(two["ddp_bf16_hook"].ranks).rows
    assert [(r["share of the weights"], r["all-gathered in"], r["reduced in"]) for r in ddp] \
        == [("100.0%", "-", "bfloat16")] * 2


def test_the_sharded_scalers_agree_bit_for_bit(two):
    torch_s, mplab_s = two["fsdp_fp16"], two["fsdp_fp16_mplab"]
    assert torch_s.losses == mplab_s.losses
    assert torch_s.scales == mplab_s.scales and torch_s.skipped_steps == mplab_s.skipped_steps
    # clipped by the norm over both ranks' shards, after unscaling
    assert len(torch_s.grad_norms) == STEPS and torch_s.grad_norms == mplab_s.grad_norms
    assert torch_s.compute_dtype == torch.float16


def test_a_compress_hook_halves_the_all_reduce_and_trains_alike(two):
    fp32, bf16 = two["ddp_fp32"], two["ddp_bf16_hook"]
    sent = _traffic(fp32)["all_reduce", "float32"]["bytes"]
    assert sent == 4 * fp32.parameters  # every gradient, once, in one step
    assert _traffic(bf16)["all_reduce", "bfloat16"]["bytes"] * 2 == sent
    assert fp32.losses != bf16.losses
    assert abs(_mean10(fp32) - _mean10(bf16)) / _mean10(fp32) < 0.01


def test_a_refused_setting_comes_back_as_raised(two):
    bad = two["bad"]
    assert bad["error"] == "ValueError" and "'fp8'" in bad["message"]
    assert "accepted" in bad["message"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_plan_is_within_5_percent_of_what_each_rank_holds(two, ranks):
    if ranks == 2:
        fsdp, ddp = two["fsdp_bf16"], two["ddp_fp32"]
    else:
        # fp32 holds what bf16 compute does ("amp": fp32 weights); no bf16 matmuls to time
        fsdp, ddp = train_across(4, *({"steps": 1, "batch_size": 4, **QUICK, "path": p}
                                      for p in ("fsdp", "torch")))
    n = fsdp.parameters
    for held, planned in ((fsdp, plan.memory(n, "amp", ranks, "fsdp")),
                          (ddp, plan.memory(n, "amp", ranks, "ddp"))):
        for report in held.ranks:
            measured = report["held_bytes"]["total"]
            assert abs(measured - planned.held) / planned.held < 0.05, (held.path, report)
    # padding: FSDP2 splits dim 0 into equal parts, so a rank holds a little more, never less
    assert sum(r["held_bytes"]["weights"] for r in fsdp.ranks) >= 4 * n


def test_one_rank_overflowing_alone(two):
    results = [two[f"overflow_{s}"] for s in ("torch", "sharded", "mplab", "mplab_alone")]
    for ranks in results[:3]:  # every rank skips, every scale backs off alike
        assert [r["stepped"] for r in ranks] == [False, False]
        assert ranks[0]["scale"] == ranks[1]["scale"] == 512.0
    alone = results[3]  # each rank saw its own shard only: the ranks part
    assert [r["stepped"] for r in alone] == [True, False]
    assert [r["scale"] for r in alone] == [1024.0, 512.0]


def test_an_fsdp_run_resumed_from_its_checkpoint_is_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    config = dict(path="fsdp", precision="fp16", steps=6, batch_size=4, save_every=3, **QUICK)
    part = str(tmp_path / "part")
    whole, stopped, resumed = run_across(2, "fsdp_jobs:losses", [
        dict(config, checkpoint_dir=str(tmp_path / "whole")),
        dict(config, checkpoint_dir=part, stop_at=3),
        dict(config, checkpoint_dir=part, resume=True)])
    assert stopped == {"stopped_at": 3} and resumed["resumed_from"] == 3
    assert resumed["losses"] == whole["losses"] and resumed["scales"] == whole["scales"]
    assert len(whole["losses"]) == 6


def test_fsdp_alone_is_fsdp_over_a_group_of_one():
    result = train(path="fsdp", precision="fp32", steps=3, batch_size=8, **QUICK)
    assert result.world_size == 1 and len(result.ranks) == 1
    shards = result.ranks[0]["shards"]
    assert all(s["shape"] == s["local_shape"] for s in shards)
    assert result.ranks[0]["held_bytes"]["total"] == 16 * result.parameters
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("settings, words", [
    (dict(path="torch", reduce_dtype="bf16"), "MixedPrecisionPolicy, on path='fsdp'"),
    (dict(path="fsdp", precision="bf16", param_dtype="fp16"), "accepted: 'fp32', 'bf16'"),
    (dict(path="fsdp", comm_hook="bf16"), "DDP's, on path='torch'"),
    (dict(path="torch", comm_hook="int8"), "accepted: 'bf16', 'fp16'"),
    (dict(path="accelerate", scaler="mplab"), "torch and fsdp paths' choice"),
])
def test_lesson_8_settings_are_checked(settings, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**settings)


def test_the_policies_table_is_the_plans_policies():
    rows = {r["policy"]: r for r in plan.policies_table().rows}
    assert set(rows) == set(plan.POLICIES) == set(plan.POLICY_WORDS)
    for name, row in rows.items():
        assert row["held"] == plan.memory(1, name).held
        assert row["+ freed after compute"] == plan.memory(1, name).transient
    assert rows["amp"]["held"] == rows["fp32"]["held"]  # the bf16 copy is freed


def test_the_planner_reproduces_the_playbook_and_refuses_nonsense():
    for n, (bf16, fp32_grads) in plan.PLAYBOOK.items():
        assert plan.memory(n, "bf16_master").gb_per_rank == pytest.approx(bf16)
        assert plan.memory(n, "bf16_fp32_grads").gb_per_rank == pytest.approx(fp32_grads)
    zero = {s: plan.memory(7e9, "bf16_master", 8, s).held / 7e9
            for s in ("zero1", "zero2", "zero3")}
    assert zero == pytest.approx({"zero1": 4 + 12 / 8, "zero2": 2 + 14 / 8, "zero3": 16 / 8})
    assert plan.memory(1e9, "amp", 8, "ddp").buckets == 4e9
    rows = plan.table([70e9], [8, 512], gpu_gb=80).rows
    assert [r["fits 80 GB"] for r in rows] == ["no", "yes"]
    for bad, words in ((dict(policy="fp8"), "accepted: 'fp32'"),
                       (dict(sharding="zero4"), "accepted: 'none'"),
                       (dict(world_size=0), "positive integer"),
                       (dict(world_size=4), "sharding='none' is one process")):
        with pytest.raises(ValueError, match=words):
            plan.memory(1e9, **bad)


def test_the_audit_names_a_low_precision_reduce_and_only_then(two):
    assert two["fsdp_bf16_reduce"].audit.has("low_precision_reduce")
    assert two["ddp_bf16_hook"].audit.has("low_precision_reduce")
    assert not two["fsdp_bf16"].audit.has("low_precision_reduce")
    assert not two["ddp_fp32"].audit.has("low_precision_reduce")
    assert two["fsdp_bf16"].audit.mixed and not two["fsdp_bf16"].audit.fallbacks


def test_what_accelerate_and_the_trainer_build_when_asked_for_fsdp(two):
    """Measured with accelerate 1.15 / transformers 5.23: on CPUs both take the FSDP settings
    without a word and build DDP (mplab's fsdp path shards there: the tests above); on GPUs
    they shard. When a release changes that, this fails, and lesson 8's words change with it."""
    built = two["libraries"]
    gpu = torch.cuda.is_available()
    expected = ("FSDP", True) if gpu else ("MULTI_CPU", False)
    assert [(b["distributed_type"], b["sharded"]) for b in built] == [expected] * 2, built
    if not gpu:
        assert [b["wrapper"] for b in built] == ["DistributedDataParallel"] * 2


def test_a_comm_hook_in_one_process_is_said_to_be_unused():
    result = train(path="torch", precision="fp32", steps=1, batch_size=8, comm_hook="bf16",
                   **QUICK)
    assert any("comm_hook='bf16' is unused" in w for w in result.warnings)
    assert result.ranks == []  # nothing crossed processes


def test_the_mystery_runs_of_exercise_8_3_show_what_their_letters_say(two):
    from mplab.train.ranks import ranks_table

    x, y = (ranks_table(two[f"mystery_{k}"].ranks).rows for k in "XY")
    # X: FSDP2 (each rank a share), gathered and reduced in bf16 -> "e"
    assert [r["share of the weights"] for r in x] == ["50.0%", "50.0%"]
    assert {(r["all-gathered in"], r["reduced in"]) for r in x} == {("bfloat16", "bfloat16")}
    # Y: DDP (everything on each rank), all-reduced in fp16 -> "c"
    assert {(r["share of the weights"], r["all-gathered in"], r["reduced in"]) for r in y} == {
        ("100.0%", "-", "float16")}
    assert lesson8.MYSTERY == {"X": "e", "Y": "c"}
    assert two["mystery_X"].audit.has("low_precision_reduce")


def test_the_all_reduce_reading_counts_bytes_and_says_what_the_backend_refused(two):
    from mplab.train.ranks import allreduce_table

    runs = {"fp32": two["ddp_fp32"], "bf16 hook": two["ddp_bf16_hook"]}
    table = allreduce_table(runs, baseline="fp32")
    assert [(r["all-reduce dtype"], r["bytes per parameter"]) for r in table.rows] == [
        ("float32", 4.0), ("bfloat16", 2.0)]
    assert table.rows[0]["step time vs fp32"] == 1.0 and table.rows[0]["loss vs fp32"] == "+0.000%"
    assert "bf16 hook sent 50% of the bytes" in table.note
    assert "took every dtype" in table.note
    refused = allreduce_table({**runs, "fp8": two["bad"]}, baseline="fp32")
    assert len(refused.rows) == 2 and "Refused: fp8: ValueError" in refused.note


def test_the_same_run_on_one_and_two_processes_agrees_to_fp32_rounding(two):
    from mplab.train.ranks import agreement_table

    alone = train(path="fsdp", precision="fp32", steps=5, batch_size=16, **QUICK)
    table = agreement_table({1: alone, 2: two["fsdp_fp32"]})
    assert [r["step"] for r in table.rows] == [1, 2, 3, 4, 5]
    for row in table.rows:
        assert row["2 processes"] == pytest.approx(row["1 process"], rel=1e-5)
    assert "rounding of the same sums" in table.note
    apart = agreement_table({1: alone, 2: two["fsdp_bf16"]})  # another run altogether
    assert "did not see the same" in apart.note


def test_the_bytes_reading_puts_each_rank_against_the_plan_and_names_the_padding(two):
    from mplab.train.ranks import held_table

    fsdp, ddp = two["fsdp_bf16"], two["ddp_fp32"]
    table = held_table([("fsdp", 2, fsdp), ("ddp", 2, ddp)])
    assert [(r["run"], r["rank"]) for r in table.rows] == [
        ("fsdp, 2 processes", 0), ("fsdp, 2 processes", 1), ("ddp, 2 processes", 0),
        ("ddp, 2 processes", 1)]
    assert table.rows[0]["held"] == fsdp.ranks[0]["held_bytes"]["total"]
    assert table.rows[2]["planned"] == 16 * ddp.parameters and table.rows[2]["off by"] == "+0.00%"
    padding = sum(r["held_bytes"]["weights"] for r in fsdp.ranks) - 4 * fsdp.parameters
    assert padding > 0 and "fsdp at 2, rank 0" in table.note and "padding" in table.note
    assert "not in .held" in table.note  # DDP's buckets: planned in .peak
    assert "not in .held" not in held_table([("fsdp", 2, fsdp)]).note
    # every rank off the plan is named, above it or below it, none left out
    for row in table.rows[:2]:  # the fsdp run's ranks; the ddp run's hold the plan
        named = f"rank {row['rank']}" in table.note or f" {row['rank']} and" in table.note \
            or f"and {row['rank']} (" in table.note
        assert named == (row["held"] != row["planned"]), (row, table.note)
    assert all(r["held"] == r["planned"] for r in table.rows[2:])
    assert ("Below it" in table.note) == any(r["held"] < r["planned"] for r in table.rows)
    assert held_table([("fsdp", 2, fsdp)], policy="fp32").rows == held_table(
        [("fsdp", 2, fsdp)], policy="amp").rows  # fp32 and amp hold the same between steps


def test_ddp_and_fsdp_side_by_side_are_read_off_the_runs_records(two):
    from mplab.train.ranks import RING, side_by_side

    ddp, fsdp = two["ddp_fp32"], two["fsdp_fp32"]
    table = side_by_side({"ddp": ddp, "fsdp": fsdp, "fsdp bf16": two["fsdp_bf16"]},
                         ddp="ddp", fsdp="fsdp")
    rows = {r["run"]: r for r in table.rows}
    assert rows["ddp"]["held per rank"] == max(r["held_bytes"]["total"] for r in ddp.ranks)
    assert rows["ddp"]["handed in per step"] == 4 * ddp.parameters  # fp32 gradients
    assert rows["ddp"]["sent per step (ring)"] == round(4 * ddp.parameters * RING["all_reduce"](2))
    handed = {(c["op"], c["dtype"]): c["bytes"] for c in fsdp.ranks[0]["collectives"]}
    assert rows["fsdp"]["handed in per step"] == sum(handed.values())
    assert rows["fsdp"]["sent per step (ring)"] == round(
        handed["all_gather", "float32"] + handed["reduce_scatter", "float32"] / 2)
    # sharded: half the bytes held, more sent; a bf16 policy halves the all-gathers
    assert rows["fsdp"]["held per rank"] < rows["ddp"]["held per rank"]
    assert rows["fsdp"]["sent per step (ring)"] > rows["ddp"]["sent per step (ring)"]
    assert "of the bytes per rank" in table.note and '"fsdp bf16"' in table.note
    assert RING["all_gather"](4) == 3 and RING["reduce_scatter"](4) == 0.75


def test_the_overflow_and_library_readings_say_who_parted_and_what_was_built(two):
    from mplab.train.libraries import built_table
    from mplab.train.ranks import collectives_table, overflow_table

    table = overflow_table({s: two[f"overflow_{s}"] for s in ("torch", "mplab_alone")})
    assert len(table.rows) == 4
    assert "Skipped on every rank: torch." in table.note and "Parted: mplab_alone" in table.note
    assert "DTensor" in table.note  # why the plain scaler held under FSDP2
    built = built_table(two["libraries"])
    assert built.rows == two["libraries"]
    if not torch.cuda.is_available():
        assert built.note.startswith("Not sharded") and "DistributedDataParallel" in built.note
    report = two["fsdp_bf16"].ranks[0]
    assert collectives_table(report).rows == report["collectives"]


def test_an_fsdp_runs_audit_reads_the_fp32_shards_after_the_evaluation(two):
    # the evaluation's forward leaves the root's weights gathered in bf16 until resharded
    fsdp = two["fsdp_bf16"]
    assert fsdp.eval_accuracy is not None
    assert fsdp.audit.param_dtypes == {"float32": fsdp.parameters}


def test_a_launch_runs_in_the_background_and_each_job_may_name_its_function():
    from mplab.train.launch import start_across

    launch = start_across(2, "math:hypot", [{}, ("json:dumps", {"obj": [1, 2]}),
                                            ("no_such_module:f", {})])
    assert launch.running  # start_across returned before the processes finished
    plain, pair, missing = launch.results()
    assert plain == 0.0 and pair == "[1, 2]" and missing["error"] == "ModuleNotFoundError"
    assert not launch.running and launch.results() == [plain, pair, missing]


def test_a_launch_that_runs_too_long_is_stopped_with_every_rank():
    import subprocess

    from mplab.train.launch import start_across

    launch = start_across(2, "time:sleep", [{"secs": 120}], timeout=2)
    with pytest.raises(TimeoutError, match="did not finish in 2 s"):
        launch.results()
    with pytest.raises(TimeoutError):  # asked again, it says the same
        launch.results()
    left = subprocess.run(["pgrep", "-f", "mplab.train.launch --nproc"], capture_output=True,
                          text=True).stdout.split()
    assert left == []


@pytest.mark.parametrize("bad, words", [
    (dict(nproc=0), "nproc must be an integer from 1 to 16"),
    (dict(function="math.sqrt"), "function must be 'module:name'"),
    (dict(jobs=[5]), "each job must be a dict"),
])
def test_a_launch_refuses_what_it_cannot_start(bad, words):
    from mplab.train.launch import start_across

    settings = {"nproc": 2, "function": "math:sqrt", "jobs": [{"x": 4}], **bad}
    with pytest.raises(ValueError, match=words):
        start_across(**settings)
