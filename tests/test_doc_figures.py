"""Figures the docs quote from a script (not a benchmark: deterministic, so checked here): each is recomputed by
the script at the size the doc states and must appear in the doc as printed."""

from __future__ import annotations

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_geometric_rs_rejection_figures():
    """README.md's 'Which correction to start with': the default geometric band's rejection at 256 and 64 tokens,
    k3_kl, and none rejected with the wider band, as scripts/geo_rs_rejection.py prints them."""
    geo = _script("geo_rs_rejection")
    with open(os.path.join(ROOT, "README.md")) as f:
        text = re.sub(r"\s+", " ", f.read())
    (band, frac, _, k3), (wide, wide_frac, _, _) = geo.rows(2000, 256, 0.02, ["0.999_1.001", "0.99_1.01"], 0)
    ((_, short_frac, _, _),) = geo.rows(500, 64, 0.02, ["0.999_1.001"], 0)
    assert (band, wide) == ("0.999_1.001", "0.99_1.01") and wide_frac == 0.0
    k3_text = f"{k3:.1e}".replace("e-0", "e-")  # 2.0e-4, as the prose writes it
    assert f"`k3_kl` = {k3_text}: {100 * frac:.1f} % rejected; {100 * short_frac:.1f} % of 500 64-token ones" in text
    assert "python scripts/geo_rs_rejection.py [--t 64 --b 500]" in text


def test_geo_rs_rejection_script_runs_at_a_tiny_size(capsys):
    _script("geo_rs_rejection").main(["--b", "8", "--t", "16"])
    assert "|---" in capsys.readouterr().out
