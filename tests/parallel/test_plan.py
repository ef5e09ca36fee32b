"""mpidist plan: the memory model reproduces the ZeRO paper and Megatron's tables."""

from __future__ import annotations

import json

import pytest

from mpidist.parallel import plan as P

ZERO_PAPER = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB per device, 7.5B params, 64 devices


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_figures(stage):
    got = P.model_state_bytes(7.5e9, precision="mixed", optimizer="adam", zero_stage=stage,
                              dp=64) / 1e9
    assert round(got, 1) == ZERO_PAPER[stage]


def test_zero_paper_figures_in_plan_rows():
    rows = P.plan(7.5e9, 64, precision="mixed", optimizer="adam", layers=32, hidden=4096,
                  heads=32, seq_len=1024, global_batch=64, max_tp=1, devices_per_node=64)
    flat = {r["zero_stage"]: r for r in rows if r["pp"] == 1 and r["tp"] == 1}
    assert sorted(flat) == [0, 1, 2, 3]
    for stage, gb in ZERO_PAPER.items():
        assert round(flat[stage]["model_state_gb"], 1) == gb
        assert flat[stage]["dp"] == 64


@pytest.mark.parametrize("precision, whole, fixed, sharded", [
    ("mixed-main-grads", 20, 4, 16),   # Megatron: float16 param, float16 grads
    ("mixed-fp32-grads", 18, 6, 12),   # Megatron: float16 param, fp32 grads
    ("fp32", 16, 8, 8),                # Megatron: fp32 param, fp32 grads
])
@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_megatron_distributed_optimizer_table(precision, whole, fixed, sharded, d):
    assert P.bytes_per_parameter(precision, "adam", 0, d) == whole
    assert P.bytes_per_parameter(precision, "adam", 1, d) == pytest.approx(fixed + sharded / d)


def test_plan_rows_carry_the_contract_fields_and_are_consistent():
    rows = P.plan(1.3e9, 16, layers=24, hidden=2048, heads=16, seq_len=2048,
                  devices_per_node=8, memory_gb=40)
    assert rows
    need = {"pp", "tp", "dp", "zero_stage", "model_state_gb", "activation_gb", "total_gb",
            "step_time_s", "fits"}
    for r in rows:
        assert need <= set(r)
        assert r["pp"] * r["tp"] * r["dp"] == 16
        assert r["total_gb"] == pytest.approx(r["model_state_gb"] + r["activation_gb"])
        assert r["fits"] == (r["total_gb"] <= 40)
        assert r["step_time_s"] >= r["compute_s"] > 0
        assert r["tp"] <= 8
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first
    json.dumps(rows)


def test_a_batch_that_does_not_divide_is_planned_as_training_splits_it():
    rows = P.plan(1.3e9, 4, layers=24, hidden=2048, heads=16, seq_len=1024, global_batch=10)
    dp4 = [r for r in rows if r["dp"] == 4 and r["zero_stage"] == 0]
    assert dp4 and dp4[0]["micro_batches"] == 3  # slices of 3, 3, 2, 2: the step waits for 3
    even = P.plan(1.3e9, 4, layers=24, hidden=2048, heads=16, seq_len=1024, global_batch=12)
    even4 = [r for r in even if r["dp"] == 4 and r["zero_stage"] == 0]
    assert even4[0]["compute_s"] == pytest.approx(dp4[0]["compute_s"])
    assert not [r for r in P.plan(1.3e9, 4, layers=24, hidden=2048, heads=16, seq_len=1024,
                                  global_batch=3) if r["dp"] == 4]


def test_sharding_reduces_memory_and_tp_splits_activations():
    rows = P.plan(1.3e9, 8, layers=24, hidden=2048, heads=16, seq_len=1024)
    by = {(r["pp"], r["tp"], r["zero_stage"]): r for r in rows}
    dp8 = [by[(1, 1, z)]["model_state_gb"] for z in range(4)]
    assert dp8 == sorted(dp8, reverse=True)
    assert by[(1, 2, 0)]["activation_gb"] < by[(1, 1, 0)]["activation_gb"]
    # slower inter-node link -> a dp group spanning nodes costs more: with flat rings, and
    # with two-level collectives when the node's link is slower than the ring inside it
    # (with a 25 GB/s port per device, 8 devices' 200 GB/s keep up with the 150 GB/s inside)
    one_node = P.plan(1.3e9, 16, layers=24, hidden=2048, heads=16, devices_per_node=16)
    key = (1, 1, 16, 0)

    def pick(rows):
        return next(r for r in rows if (r["pp"], r["tp"], r["dp"], r["zero_stage"]) == key)

    for extra in ({"hierarchical": False}, {"node_bw": 25e9}):
        two_nodes = P.plan(1.3e9, 16, layers=24, hidden=2048, heads=16, devices_per_node=8,
                           **extra)
        assert pick(two_nodes)["dp_comm_s"] > pick(one_node)["dp_comm_s"]


def test_alpha_beta_formulas():
    assert P.allreduce_time(1e9, 1, 1e-5, 1e10) == 0.0
    assert P.allreduce_time(1e9, 4, 1e-5, 1e10) == pytest.approx(6e-5 + 1.5 * 0.1)
    assert P.reduce_scatter_time(1e9, 4, 1e-5, 1e10) == pytest.approx(3e-5 + 0.75 * 0.1)
    assert P.allgather_time(8, 2, 0.0, 1.0) == 4.0


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="precision='fp8'"):
        P.bytes_per_parameter("fp8")
    with pytest.raises(ValueError, match="optimizer='adafactor'"):
        P.plan(1e9, 8, optimizer="adafactor")
    with pytest.raises(ValueError, match="zero_stage=4"):
        P.bytes_per_parameter("mixed", "adam", 4, 8)
    with pytest.raises(ValueError, match="params=-1"):
        P.plan(-1, 8)
    with pytest.raises(ValueError, match="devices=0"):
        P.plan(1e9, 0)
    with pytest.raises(ValueError, match="'7.5X'"):
        P.parse_count("7.5X")
    assert P.parse_count("7.5B") == 7.5e9 and P.parse_count("350M") == 3.5e8


def test_main_json(capsys):
    assert P.main(["--params", "7.5B", "--devices", "64", "--optimizer", "adam",
                   "--precision", "mixed", "--layers", "32", "--hidden", "4096",
                   "--heads", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] and all(r["fits"] for r in out["rows"])
    assert {"pp", "tp", "dp", "zero_stage", "model_state_gb"} <= set(out["rows"][0])


def test_main_table_and_add_parser(capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="mpidist")
    sub = parser.add_subparsers(dest="command")
    P.add_parser(sub)
    args = parser.parse_args(["plan", "--params", "1.3e9", "--devices", "8", "--precision",
                              "fp32", "--top", "3"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "layouts fit" in text and "states GB" in text


def test_group_time_two_network_levels():
    c = P.Cluster(devices=4, devices_per_node=2, intra_bw=10e9, intra_latency=0.0,
                  inter_bw=1e9, inter_latency=0.0, node_bw=0.125e9)
    s = 16 * 2**20
    # inside a node: the ring over the intra-node link
    assert P.group_time("allreduce", s, 2, 1, c) == P.allreduce_time(s, 2, 0.0, 10e9)
    # 2 nodes x 2 ranks: every node sends S through its 1 Gbit/s link, then the node ring
    two = P.group_time("allreduce", s, 4, 1, c)
    assert two == pytest.approx(s / 0.125e9)  # the node ring hides behind the link
    assert P.group_time("reduce_scatter", s, 4, 1, c) == pytest.approx(s / 2 / 0.125e9)
    slow_intra = P.Cluster(devices=4, devices_per_node=2, intra_bw=0.1e9, intra_latency=0.0,
                           inter_bw=1e9, inter_latency=0.0, node_bw=0.125e9)
    assert P.group_time("allreduce", s, 4, 1, slow_intra) == P.allreduce_time(s, 2, 0.0, 0.1e9)
    # a flat ring instead moves 2(n-1)/n S per rank over the inter-node link
    flat = P.Cluster(devices=4, devices_per_node=2, intra_bw=10e9, intra_latency=0.0,
                     inter_bw=1e9, inter_latency=0.0, node_bw=0.125e9, hierarchical=False)
    assert P.group_time("allreduce", s, 4, 1, flat) == P.allreduce_time(s, 4, 0.0, 1e9)
    # dp groups of stride tp=2 on 2-device nodes: one rank per node, a flat ring
    assert P.group_time("allreduce", s, 2, 2, c) == P.allreduce_time(s, 2, 0.0, 1e9)
    # two dp groups (stride 2) share each 4-device node's link: twice the time across
    c4 = P.Cluster(devices=8, devices_per_node=4, intra_bw=10e9, intra_latency=0.0,
                   inter_bw=1e9, inter_latency=0.0, node_bw=0.125e9)
    assert P.group_time("allgather", s, 4, 2, c4) == pytest.approx(2 * s / 2 / 0.125e9)
    with pytest.raises(ValueError, match="node_bw=-1"):
        P.Cluster(devices=4, node_bw=-1)


def test_zero_sync_time_composition():
    def sync(kind, nbytes):
        return {"allreduce": 2.0, "reduce_scatter": 1.0, "allgather": 1.0}[kind] * nbytes

    assert P.zero_sync_time(0, 10, 5, 3, sync) == 20
    assert P.zero_sync_time(1, 10, 5, 3, sync) == 25
    assert P.zero_sync_time(2, 10, 5, 3, sync) == 15
    assert P.zero_sync_time(3, 10, 5, 3, sync) == 10 + 2 * 3 * 5


@pytest.mark.parametrize("params, shape", [
    (7.5e9, (36, 4096, 32)), (1.3e9, (24, 2048, 16)), (13e9, (40, 5120, 40)),
    (175e9, (96, 12288, 96)), (1e6, (1, 256, 2)),
])
def test_default_shapes_have_heads_that_tensor_parallelism_divides(params, shape):
    assert P.default_shape(params) == shape
    layers, hidden, heads = shape
    assert hidden == 128 * heads
    assert heads < 8 or heads % 8 == 0  # tp of 1, 2, 4, 8 divides every default head count
    assert layers < 6 or layers % 4 == 0
    assert 0.8 < 12 * layers * hidden ** 2 / params < 1.25 or params < 1e7
    with pytest.raises(ValueError, match="params=0"):
        P.default_shape(0)


def test_default_plan_for_7_5b_proposes_tensor_parallelism():
    rows = P.plan(7.5e9, 64, precision="mixed")
    assert {r["tp"] for r in rows} == {1, 2, 4, 8}
    assert rows[0]["fits"]


def test_plan_command_prints_its_model_shape_and_documents_the_shape_flags():
    import subprocess
    import sys

    def plan(*args):
        proc = subprocess.run([sys.executable, "-m", "mpidist.cli", "plan", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    out = plan("--params", "7.5B", "--devices", "64", "--precision", "mixed")
    assert out.splitlines()[0] == (
        "model: 36 layers, hidden 4096, 32 heads (size 128), sequence 2048: the default shape "
        "for 7.5e+09 parameters (--layers, --hidden, --heads change it)")
    tps = {int(line.split()[1]) for line in out.splitlines()[3:] if line.split()[9] == "yes"}
    assert tps > {1}
    out = plan("--params", "7.5B", "--devices", "64", "--layers", "32", "--hidden", "5120")
    assert out.splitlines()[0] == ("model: 32 layers, hidden 5120, 40 heads (size 128), "
                                   "sequence 2048 (--heads from 7.5e+09 parameters)")
    rows = json.loads(plan("--params", "7.5B", "--devices", "64", "--json"))
    assert rows["model"] == {"layers": 36, "hidden": 4096, "heads": 32, "seq_len": 2048,
                             "defaulted": ["layers", "hidden", "heads"]}
    text = plan("--help")
    for flag, words in (("--layers", "transformer layers"), ("--hidden", "hidden size"),
                        ("--heads", "attention heads")):
        assert f"{flag} {flag[2:].upper()}" in text and words in text


def test_schedules_and_recompute_in_the_plan():
    """Zero-bubble's smaller bubble and recompute's smaller activations (one more forward)
    enter the ranking; pp=1 rows do not depend on the schedule."""
    from mpidist.parallel.plan import activation_bytes, pipeline_compute_factor, plan
    from mpidist.parallel.schedules import orders, simulate, step_units

    for p, m in [(2, 4), (4, 8), (3, 5)]:
        for s in ("gpipe", "1f1b", "zero-bubble"):
            assert step_units(s, p, m) == simulate(orders(s, p, m), f=1, b=1, w=1).step
    assert pipeline_compute_factor("1f1b", "none", 4, 8) == pytest.approx(1 + 3 / 8)
    assert pipeline_compute_factor("zero-bubble", "none", 2, 4) == pytest.approx(13 / 12)
    assert pipeline_compute_factor("1f1b", "blocks", 1, 4) == pytest.approx(4 / 3)
    shape = dict(layers=8, hidden=64, heads=4, seq_len=32, micro_batch=2, tp=1, pp=2,
                 micro_batches=8, act_bytes=2)
    assert activation_bytes(**shape, recompute="blocks") == 32 * 2 * 64 * 2 * 4 * 2
    assert activation_bytes(**shape, schedule="gpipe") == \
        4 * activation_bytes(**shape, schedule="1f1b")
    rows = plan(7.5e9, 64, schedules=("1f1b", "zero-bubble"), recompute=("none", "blocks"))
    key = {(r["pp"], r["tp"], r["dp"], r["zero_stage"], r["schedule"], r["recompute"]): r
           for r in rows}
    for (pp, tp, dp, z, s, rc), r in key.items():
        if pp > 1 and s == "zero-bubble":
            assert r["step_time_s"] < key[(pp, tp, dp, z, "1f1b", rc)]["step_time_s"]
        if rc == "blocks":
            assert r["activation_gb"] < key[(pp, tp, dp, z, s, "none")]["activation_gb"]
        if pp == 1:
            assert s == "1f1b"
    with pytest.raises(ValueError, match="schedule 'zb-v' is not one of"):
        plan(7.5e9, 64, schedules=("zb-v",))


def test_interleaved_in_the_plan():
    """The interleaved schedule's bubble divided by its virtual stages (the simulator's
    step), its activations counted on its orders (1 + (p-1)/(p v) times 1F1B's), its
    messages v times as many; layouts it cannot run skipped."""
    from mpidist.parallel.plan import activation_bytes, pipeline_compute_factor, plan
    from mpidist.parallel.schedules import orders, peak_in_flight, simulate, step_units

    for p, m, v in [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 4, 4)]:
        sim = simulate(orders("interleaved", p, m, v), f=1 / v, b=1 / v, w=1 / v)
        assert step_units("interleaved", p, m, v) == pytest.approx(sim.step)
    assert pipeline_compute_factor("interleaved", "none", 4, 8, 2) == pytest.approx(9.5 / 8)
    assert peak_in_flight("interleaved", 4, 8, 2) == 11 and peak_in_flight("1f1b", 4, 8) == 4
    shape = dict(layers=8, hidden=64, heads=4, seq_len=32, micro_batch=2, tp=1, pp=4,
                 micro_batches=8, act_bytes=2)
    assert activation_bytes(**shape, schedule="interleaved", virtual_stages=2) == \
        pytest.approx((1 + 3 / 8) * activation_bytes(**shape, schedule="1f1b"))
    rows = plan(7.5e9, 64, layers=32, schedules=("1f1b", "interleaved"),
                virtual_stages=(2, 4))
    key = {(r["pp"], r["tp"], r["dp"], r["zero_stage"], r["schedule"], r["virtual_stages"]): r
           for r in rows}
    seen = set()
    for (pp, tp, dp, z, s, v), r in key.items():
        if s != "interleaved" or pp == 1:
            continue
        seen.add(v)
        assert 32 % (pp * v) == 0 and r["micro_batches"] % pp == 0
        one = key[(pp, tp, dp, z, "1f1b", 1)]
        assert r["compute_s"] < one["compute_s"]
        assert r["activation_gb"] >= one["activation_gb"]
        assert r["pp_comm_s"] == pytest.approx(v * one["pp_comm_s"])
    assert seen == {2, 4}
    with pytest.raises(ValueError, match="virtual stages 1 must be an integer >= 2"):
        plan(7.5e9, 64, schedules=("interleaved",), virtual_stages=(1,))


def test_copies_of_in_job_recovery_match_what_the_strategy_keeps():
    """The planner's host copies against Redundancy's own count (fp32 AdamW: W=4, M=8)."""
    from mpidist.parallel.plan import copies_bytes

    params = 1000
    assert copies_bytes(params, precision="fp32", optimizer="adamw", zero_stage=0,
                        dp=4) == 12 * params  # the whole snapshot
    # ZeRO-2: snapshot + two copies of the shard (12 bytes/param each) + the gradient shard
    assert copies_bytes(params, precision="fp32", optimizer="adamw", zero_stage=2,
                        dp=4) == (3 * 12 + 4) * params / 4
    assert copies_bytes(params, precision="fp32", optimizer="adamw", zero_stage=1,
                        dp=4) == 3 * 12 * params / 4
    # pp or tp: the same within a column where dp >= 2 ...
    assert copies_bytes(params, precision="fp32", optimizer="adamw", zero_stage=1, dp=4,
                        tp=2) == 3 * 12 * params / 4
    # ... and where dp is 1, the snapshot and the double-buffered copy of another column
    assert copies_bytes(params, precision="fp32", optimizer="adamw", zero_stage=0, dp=1,
                        tp=2, pp=2) == 3 * 12 * params
    rows = P.plan(8e9, 16, zero_stages=(1,))
    assert all(r["copies_gb"] > 0 for r in rows)
