"""`make gpu-check`'s script (examples/device_check.py), run on CPU ranks: it reports every case equal
(a bf16 case against FSDP2 under the same `MixedPrecisionPolicy` among them, and a `no_sync` window)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_on_cpu_ranks_reports_equal():
    cases = ["single_eager", "dp2_zero3_window", "single_bf16_eager"]
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "device_check.py"), "--device", "cpu",
                          "--cases", ",".join(cases)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith(tuple(cases))]
    assert [row[0] for row in rows] == cases and all(row[-1] == "equal" for row in rows)
    assert rows[-1][2:4] == ["0.00e+00", "0.00e+00"]  # bf16 with eager codegen: FSDP2's numbers, bit for bit
    assert "all cases passed" in run.stdout


def test_device_check_names_a_case_it_does_not_know():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "device_check.py"), "--device", "cpu",
                          "--cases", "dp3_zero9"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown cases ['dp3_zero9']" in run.stderr


def test_device_check_plans_the_cases_it_has_too_few_ranks_for():
    """With `--plan`, a case of more ranks than there are runs as rank 0 of a fake process
    group (on one GPU: planned for its kernels), a Hugging Face model with a padded batch too."""
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "device_check.py"), "--device", "cpu", "--nproc",
                          "1", "--plan", "--cases", "dp2_zero3_window,hf_bert_dp2_zero2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("dp2_zero3_window", "hf_bert_dp2_zero2"))]
    assert len(rows) == 2 and all(row.endswith("planned and ran as rank 0 of a fake group") for row in rows), rows
