"""`python -m ecoserve` is the `ecoserve` command."""
import subprocess
import sys


def test_python_m_ecoserve_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "ecoserve", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--api-key", "--metrics-prefix", "--tool-call-parser", "--max-request-body-bytes",
                 "--enable-admin-api", "--metrics-public"):
        assert flag in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ecoserve", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
