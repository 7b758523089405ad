"""benchmarks/sim_refit.py: which measured runs a --fit-runs name stands for."""
from __future__ import annotations

import pytest
from bench_scripts import import_benchmark

sim_refit = import_benchmark("sim_refit")


def test_run_tags_expand_a_repeated_cell_in_repeat_order(tmp_path) -> None:
    for tag in ("chat-0.4", "decode-heavy-0.8-rep2", "decode-heavy-0.8-rep10",
                "decode-heavy-0.8-rep1"):
        (tmp_path / f"{tag}-steps.json").write_text("[]")
    assert sim_refit.run_tags(tmp_path, "chat-0.4") == ["chat-0.4"]
    assert sim_refit.run_tags(tmp_path, "decode-heavy-0.8-rep2") == ["decode-heavy-0.8-rep2"]
    assert sim_refit.run_tags(tmp_path, "decode-heavy-0.8") == [
        "decode-heavy-0.8-rep1", "decode-heavy-0.8-rep2", "decode-heavy-0.8-rep10"]
    with pytest.raises(SystemExit, match="no measured run 'prefill-heavy-0.4'.*chat-0.4"):
        sim_refit.run_tags(tmp_path, "prefill-heavy-0.4")
