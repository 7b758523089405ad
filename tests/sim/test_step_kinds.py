"""benchmarks/sim_step_kinds.py --by-rows: which steps land in which row band, and how a
calibration's samples split into its grid and its serving scenario."""
from __future__ import annotations

import json

from bench_scripts import import_benchmark

from duetserve.sim.cost import FEATURES, CalibratedCost

sim_step_kinds = import_benchmark("sim_step_kinds")


def _cost() -> CalibratedCost:
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("step")] = 1e-3
    coef[FEATURES.index("rows_few")] = 1e-3
    return CalibratedCost(tuple(coef), 32, chunk_rows=8)     # t = (1 + rows) ms


def test_row_bands_take_warm_decode_row_steps_by_rows() -> None:
    cost = _cost()
    steps = [
        ([(1, 10, True)], 0.004, False),                     # 1 row: 2 ms predicted
        ([(1, 10, True)] * 3, 0.004, False),                 # 3 rows: 4 ms
        ([(1, 10, True), (5, 0, False)], 0.014, False),      # decode + 5-token chunk: 6 rows
        ([(1, 10, True)] * 3, 0.040, True),                  # cold: left out
        ([(20, 0, True)], 0.1, False),                       # a prefill slice: left out
    ]
    bands = sim_step_kinds.row_bands(cost, steps)
    assert dict(bands) == {(1, 1): [2.0], (2, 4): [1.0], (5, 8): [2.0]}
    assert sim_step_kinds.band_cells(bands) == ["2.000 (1)", "1.000 (1)", "2.000 (1)", "-"]


def test_calibration_parts_split_each_calibration_at_its_grid(tmp_path) -> None:
    def samples(n_grid: int, n_serving: int) -> dict:
        rows = [[[[1, 5, True]], 0.01]] * (n_grid + n_serving)
        return {"samples": rows, "cold": [False] * len(rows), "grid_steps": n_grid}
    (tmp_path / "profile-1.samples.json").write_text(json.dumps(samples(2, 3)))
    (tmp_path / "profile-2.samples.json").write_text(json.dumps(samples(1, 4)))
    (tmp_path / "profile.samples.json").write_text(json.dumps(samples(3, 7)))  # pooled
    parts = dict(sim_step_kinds.calibration_parts(tmp_path / "profile.json"))
    assert len(parts["calibration grid"]) == 3
    assert len(parts["calibration serving"]) == 7
    single = tmp_path / "one"
    single.mkdir()
    (single / "cal.samples.json").write_text(json.dumps(samples(4, 1)))
    parts = dict(sim_step_kinds.calibration_parts(single / "cal.json"))
    assert (len(parts["calibration grid"]), len(parts["calibration serving"])) == (4, 1)


def test_after_prefill_splits_decode_row_steps_by_the_step_before() -> None:
    cost = _cost()
    steps = [
        ([(1, 10, True)], 0.010, False),                     # first step: nothing before it
        ([(20, 0, True)], 0.1, False),                       # a prefill slice: not counted
        ([(1, 10, True)], 0.004, False),                     # after a prefill: 2 ms -> 2.0
        ([(1, 10, True)] * 3, 0.004, False),                 # after no prefill: 1.0
        ([(1, 10, True), (20, 0, False)], 0.05, False),      # mixed: a prefill slice
        ([(1, 10, True)], 0.006, True),                      # cold: left out
        ([(1, 10, True)], 0.003, False),                     # after no prefill: 1.5
    ]
    got = sim_step_kinds.after_prefill(cost, steps)
    assert got == {"after a prefill": [2.0], "after no prefill": [1.0, 1.5]}


def test_repeat_steps_keep_each_repeat_in_order_with_its_cold_flags(tmp_path) -> None:
    for rep, secs in ((1, [0.1, 0.2]), (2, [0.3])):
        tag = f"chat-0.8-rep{rep}"
        (tmp_path / f"{tag}-steps.json").write_text(json.dumps(
            [[i, s, [[1, 5, True]]] for i, s in enumerate(secs)]))
        (tmp_path / f"{tag}-stepinfo.json").write_text(json.dumps(
            {"cold": [True] + [False] * (len(secs) - 1)}))
    reps = list(sim_step_kinds.repeat_steps(tmp_path, "chat", "0.8"))
    assert [tag for tag, _ in reps] == ["chat-0.8-rep1", "chat-0.8-rep2"]
    assert reps[0][1] == [([[1, 5, True]], 0.1, True), ([[1, 5, True]], 0.2, False)]
    assert list(sim_step_kinds.run_steps(tmp_path, "chat", "0.8")) == reps[0][1] + reps[1][1]


def test_prefill_kinds_split_by_kind_context_and_cold() -> None:
    cost = _cost()
    steps = [
        ([(1, 10, True)], 0.002, False),                     # decode-only: left out
        ([(20, 0, True)], 0.042, False),                     # fresh prompt: 21 ms predicted
        ([(20, 30, True)], 0.021, False),                    # the rest of a prompt
        ([(20, 30, True)], 0.063, True),                     # the same, cold
        ([(1, 10, True), (5, 7, False)], 0.014, False),      # decode + a chunk after 7
        ([(1, 10, True), (5, 0, False)], 0.007, False),      # decode + a fresh chunk
    ]
    got = sim_step_kinds.prefill_kinds(cost, steps)
    assert set(got) == {"prefill-only, fresh, warm", "prefill-only, chunk after context, warm",
                        "prefill-only, chunk after context, cold",
                        "mixed, chunk after context, warm", "mixed, fresh, warm"}
    ratios = {k: round(m / p, 6) for k, [(m, p)] in got.items()}
    assert ratios["prefill-only, fresh, warm"] == 2.0
    assert ratios["prefill-only, chunk after context, warm"] == 1.0
    assert ratios["prefill-only, chunk after context, cold"] == 3.0
    assert ratios["mixed, chunk after context, warm"] == 2.0
    assert ratios["mixed, fresh, warm"] == 1.0
    assert sim_step_kinds.kind_cell(got["mixed, fresh, warm"]) == "1.000 / 1.000 (1)"
    assert sim_step_kinds.kind_cell([]) == "-"
