"""The parity CLI prints its table and exits 0 / 1 / 2 correctly."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("eae_runtime")

from eae_jax import cli  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--dim", "32", "--heads", "4", "--kv-heads", "2", "--depth", "2", "--ffn-hidden", "48", "--seq", "8"]


def test_parity_passes_and_writes_json(tmp_path, capsys):
    out = str(tmp_path / "report.json")
    code = cli.main(["parity", *SMALL, "--pipelines", "none", "--json", out])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "== parity:" in printed and "result: PASS" in printed and "adjoint[none]" in printed
    report = json.load(open(out))
    assert report["ok"] is True and report["dtype"] == "float32"
    assert {r["section"] for r in report["rows"]} == {"forward", "grad", "adjoint[none]", "vjp[none]"}


def test_parity_fails_on_a_perturbed_weight(capsys):
    code = cli.main(["parity", *SMALL, "--pipelines", "", "--perturb", "1e-3"])
    printed = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in printed and "result: FAIL" in printed


def test_parity_fails_under_an_impossible_tolerance(capsys):
    assert cli.main(["parity", *SMALL, "--pipelines", "", "--tol", "1e-12"]) == 1
    assert "result: FAIL" in capsys.readouterr().out


def test_parity_errors_exit_2(tmp_path, capsys):
    assert cli.main(["parity", str(tmp_path / "missing.pt")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"definitely not a checkpoint" * 10)
    assert cli.main(["parity", str(junk)]) == 2
    assert "unknown checkpoint format" in capsys.readouterr().err
    assert cli.main(["parity", "--pipelines", "fp8"]) == 2
    assert cli.main(["nonsense"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "parity" in capsys.readouterr().out


def test_parity_on_a_saved_block_stack(tmp_path, capsys):
    from eae_runtime.contrib import PreNormTransformerBlock

    torch.manual_seed(0)
    path = str(tmp_path / "stack.pt")
    torch.save(torch.nn.ModuleList([PreNormTransformerBlock(32, 4, 1, max_seq_len=32, ffn_hidden_dim=48)]), path)
    assert cli.main(["parity", path, "--pipelines", "fp16", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "stack.pt" in out and "pass[fp16]" in out


def test_eae_jax_cli_does_not_import_torch():
    code = "import sys, eae_jax.cli; assert 'torch' not in sys.modules, 'eae_jax.cli imported torch'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@pytest.mark.slow
def test_console_entry_points_exit_codes():
    """The installed ``eae-jax`` script and ``python -m interop.cli`` (separate processes)."""
    exe = os.path.join(os.path.dirname(sys.executable), "eae-jax")
    base = [exe] if os.path.exists(exe) else [sys.executable, "-m", "eae_jax.cli"]
    ok = subprocess.run([*base, "parity", *SMALL, "--depth", "1", "--pipelines", ""], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "result: PASS" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "interop.cli", "parity", *SMALL, "--depth", "1", "--pipelines", "",
                          "--perturb", "1e-2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "result: FAIL" in bad.stdout
