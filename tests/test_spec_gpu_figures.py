"""scripts/spec_gpu_figures.py (the GPU lease's speculation figures) works before a GPU is
at hand: on tiny shapes on CPU, every case runs and lands its figure, the acceptance it
reads following the synthetic setting (length 1: nothing accepted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_spec_gpu_figures_writes_every_case(smollm2, tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/spec_gpu_figures.py", "--cpu", "--assets", str(smollm2), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "spec_figures.json").read_text())
    assert report["spec_token_ms_none"] > 0
    for case in ("draft_model_len3", "draft_model_len1", "eagle3_len3"):
        assert report[f"spec_ratio_{case}"] > 0, case
    assert report["spec_acceptance_length_draft_model_len1"] == 1.0
    assert 2.0 < report["spec_acceptance_length_draft_model_len3"] <= 3.5
