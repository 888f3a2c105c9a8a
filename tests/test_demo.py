"""The main job, end to end in its quick form: MCL hypotheses take the two modes that MLE averages."""

import json
import os
import subprocess
import sys


def test_quick_demo_specialises_and_writes_its_outputs(tmp_path):
    command = [sys.executable, "-m", "loramcl.cli", "demo", "--quick", "true", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Wrote {tmp_path / 'report.json'}" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    mle, mcl = report["mle"], report["mcl"]
    assert mle["trainable_parameters"] == mcl["trainable_parameters"]  # rank K*r vs K hypotheses of rank r
    assert mcl["oracle_nll_per_token"] < mle["oracle_nll_per_token"]
    up = [share["up"] for share in mcl["direction_share"]]
    down = [share["down"] for share in mcl["direction_share"]]
    assert max(up) >= 0.8 and max(down) >= 0.8 and up.index(max(up)) != down.index(max(down))
    for name in ("mle", "mcl"):
        assert {"mcl_adapters.safetensors", "mcl_config.json"} <= set(os.listdir(tmp_path / name))


def test_cli_help_lists_the_commands():
    result = subprocess.run([sys.executable, "-m", "loramcl.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("demo", "evaluate", "plot-tradeoff"):
        assert command in result.stdout
