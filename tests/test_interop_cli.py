"""The parity CLI prints its table and exits 0 / 1 / 2 correctly."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

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


# ----------------------------------------------------------------------------- every documented exit code
def _err_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("eae-jax parity: error: "), err
    return err


def test_an_empty_comparison_is_not_agreement(capsys):
    """--batch 0 --perturb 1e-3 exited 0: nothing compared was reported as agreement."""
    assert cli.main(["parity", *SMALL, "--pipelines", "", "--batch", "0", "--perturb", "1e-3"]) == 2
    assert "--batch must be >= 1, got 0" in _err_line(capsys)
    from interop.parity import ParityReport, compare

    assert all(np.isnan(v) for v in compare(np.zeros((0, 3)), np.zeros((0, 3))))
    assert not ParityReport("empty", "float32", [], {}).ok


def test_summary_line_shows_nan_rows():
    """A NaN row hid behind the finite maximum: 'worst rel err: forward 0.000e+00'."""
    from interop.parity import ParityReport, Row

    rows = [Row("forward", "x0", 0.0, 0.0, 1.0, 1e-5, True), Row("forward", "x1", np.nan, np.nan, np.nan, 1e-5, False),
            Row("grad", "dL/dx0", 1e-7, 1e-7, 1.0, 1e-5, True)]
    report = ParityReport("t", "float32", rows, {})
    last = report.table().splitlines()[-1]
    assert "forward nan" in last and "grad 1.000e-07" in last and "1 of them NaN" in last
    assert np.isnan(report.worst("forward")) and not report.ok


@pytest.fixture(scope="module")
def tiny_llama2c(tmp_path_factory):
    """A llama2.c model whose position tables stop at 12."""
    import jax

    import interop
    from eae_jax.blocks import BlockConfig
    from eae_jax.models import LMConfig, init_lm

    lm = LMConfig(11, 1, BlockConfig(16, 4, 2, 20, norm_eps=1e-5, max_seq_len=12), tie_embeddings=True)
    path = str(tmp_path_factory.mktemp("l2c") / "m.bin")
    interop.save_llama2c_bin(path, init_lm(jax.random.key(0), lm), lm)
    return path


def test_seq_beyond_the_models_maximum_exits_2_before_torch_runs(tiny_llama2c, capsys, monkeypatch):
    """--seq 600 on stories260K (max 512) was a torch traceback and exit 1 ('over tolerance')."""
    import interop.parity as parity

    monkeypatch.setattr(parity, "_torch_autograd", lambda case: pytest.fail("torch ran"))
    assert cli.main(["parity", tiny_llama2c, "--seq", "13", "--pipelines", ""]) == 2
    assert "seq 13 is longer than the model's position tables allow (max_seq_len 12)" in _err_line(capsys)
    assert cli.main(["parity", *SMALL, "--seq", "300", "--max-seq-len", "256"]) == 2
    assert "--seq 300 is longer than --max-seq-len 256" in _err_line(capsys)


@pytest.mark.parametrize("args, match", [
    (["--tol", "-1"], "--tol must be a finite number > 0, got -1.0"),  # every row then failed
    (["--tol", "nan"], "--tol must be a finite number > 0, got nan"),
    (["--tol", "0"], "--tol must be a finite number > 0"),
    (["--seq", "0"], "--seq must be >= 1"),
    (["--depth", "0"], "--depth must be >= 1"),
    (["--heads", "3"], "--dim 32 is not a multiple of --heads 3"),
    (["--kv-heads", "3"], "--heads 4 is not a multiple of --kv-heads 3"),
    (["--norm-eps", "-1"], "--norm-eps must be a finite number > 0"),
    (["--seed", "-1"], r"--seed must be in \[0, 2147483647\]"),
    (["--perturb", "inf"], "--perturb must be a finite number"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["--batch", "two"], "argument --batch: invalid int value"),
    (["--pipelines", "fp8"], r"unknown pipeline\(s\) \['fp8'\]"),
    (["--json", "/proc/no/such/dir/r.json"], "cannot write --json /proc/no/such/dir/r.json"),
])
def test_bad_arguments_exit_2_before_anything_runs(args, match, capsys, monkeypatch):
    import interop.parity as parity

    monkeypatch.setattr(parity, "blocks_case", lambda *a, **k: pytest.fail("built a case for a bad argument"))
    assert cli.main(["parity", *SMALL, *args]) == 2
    assert re.search(match, _err_line(capsys))


def test_json_path_is_checked_before_the_run(tmp_path, capsys, monkeypatch):
    """An unwritable --json failed only after the whole run, with a traceback."""
    import interop.parity as parity

    monkeypatch.setattr(parity, "blocks_case", lambda *a, **k: pytest.fail("ran before checking --json"))
    (tmp_path / "dir.json").mkdir()
    assert cli.main(["parity", *SMALL, "--json", str(tmp_path / "dir.json")]) == 2
    assert "is a directory" in _err_line(capsys)
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            assert cli.main(["parity", *SMALL, "--json", str(ro / "r.json")]) == 2
            assert "cannot write --json" in _err_line(capsys)
        finally:
            ro.chmod(0o755)


def test_exit_3_for_an_internal_error(capsys, monkeypatch):
    import interop.parity as parity

    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(parity, "run_parity", bug)
    assert cli.main(["parity", *SMALL, "--pipelines", ""]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("eae-jax parity: internal error")


def test_help_lists_the_exit_codes(capsys):
    assert cli.main(["parity", "--help"]) == 0
    assert "exit codes:" in capsys.readouterr().out


# ----------------------------------------------------------------------------- properties
class Reached(BaseException):
    """Raised where a case would be built: every argument was accepted."""


_PARITY_FLAGS = {
    "--dim": st.integers(-1, 48), "--heads": st.integers(-1, 5), "--kv-heads": st.integers(-1, 5),
    "--depth": st.integers(-1, 3), "--ffn-hidden": st.integers(-1, 64), "--max-seq-len": st.integers(-1, 40),
    "--norm-eps": st.sampled_from(["1e-6", "0", "-1", "nan", "inf", "x"]),
    "--dtype": st.sampled_from(["float32", "bf16", "fp16", ""]), "--batch": st.integers(-1, 3),
    "--seq": st.integers(-1, 50), "--seed": st.integers(-2, 2**40),
    "--pipelines": st.sampled_from(["", "none", "int8_clip,fp16", "fp8", ",,", "none,bogus"]),
    "--tol": st.sampled_from(["1e-5", "0", "-1", "nan", "inf", "1e400"]),
    "--perturb": st.sampled_from(["0", "1e-3", "-1", "nan", "inf"]),
    "--json": st.sampled_from(["ok.json", "", "/proc/x/r.json", "dir"]),
}


@st.composite
def parity_argv(draw):
    flags = draw(st.lists(st.sampled_from(sorted(_PARITY_FLAGS)), max_size=6, unique=True))
    argv = []
    for flag in flags:
        argv += [flag, str(draw(_PARITY_FLAGS[flag]))]
    if draw(st.booleans()):
        argv.insert(0, draw(st.sampled_from(["missing.pt", "junk.bin", "dir", "tiny.bin"])))
    return argv


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(argv=parity_argv())
def test_any_parity_command_line_is_accepted_or_refused_in_one_line(argv, tiny_llama2c, tmp_path_factory, capsys,
                                                                    monkeypatch):
    import interop.parity as parity

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(parity, "blocks_case", reached)
    monkeypatch.setattr(parity, "checkpoint_case", reached)
    d = tmp_path_factory.mktemp("p")
    (d / "dir").mkdir()
    (d / "junk.bin").write_bytes(b"junk" * 20)
    where = {"tiny.bin": tiny_llama2c, "ok.json": str(d / "ok.json"), "dir": str(d / "dir"),
             "missing.pt": str(d / "missing.pt"), "junk.bin": str(d / "junk.bin")}
    argv = [where.get(a, a) for a in argv]
    capsys.readouterr()
    try:
        code = cli.main(["parity", *argv])
    except Reached:
        event("accepted")
        return
    event("refused")
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
