"""Compiling the kernels ahead (sae_env.precompile) and the suite's use of it (conftest.WARM_ORDER)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import WARM_ORDER

from sae_env.fast_engine import AVAILABLE
from sae_env.fast_engine.twin import twin_class
from sae_env.policies import make_policy, policy_names
from sae_env.precompile import MODES, compiled_policies, kernels, parse_kernels, warm


def test_every_policy_with_a_twin_has_its_kernels():
    twins = {twin_class(make_policy(n)) for n in policy_names()} - {None}
    assert {twin_class(make_policy(n)) for n in compiled_policies()} == twins
    assert len(compiled_policies()) == len(twins)  # one name per twin (saecache-paper shares saecache's)
    assert kernels() == [(n, m) for n in compiled_policies() for m in MODES]


def test_the_suite_warms_every_kernel_once():
    """A new twin must join the suite's order (or its kernels compile inside the tests again)."""
    order = parse_kernels(WARM_ORDER)
    assert sorted(order) == sorted(kernels())
    assert len(set(order)) == len(order)


def test_parse_kernels():
    assert parse_kernels("lru:timed, lpc") == [("lru", "timed"), ("lpc", "instant"), ("lpc", "timed")]
    assert parse_kernels("") == []
    with pytest.raises(ValueError, match="unknown compiled policy 'mru'"):
        parse_kernels("mru")  # a policy, but without a twin
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        parse_kernels("lru:fast")


@pytest.mark.parametrize("arg", ["bogus", "lru:fast"])
def test_cli_rejects_bad_kernels_with_one_line(arg):
    r = subprocess.run([sys.executable, "-m", "sae_env.precompile", "--kernels", arg],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and "--kernels" in r.stderr


@pytest.mark.skipif(not AVAILABLE, reason="needs numba")
def test_warm_replays_each_kernel_asked_for():
    done = warm([("lru", "instant"), ("lru", "timed")])
    assert [(n, m) for n, m, _ in done] == [("lru", "instant"), ("lru", "timed")]
    assert all(s >= 0 for _, _, s in done)


def test_cli_without_numba_says_so_in_one_line(monkeypatch, capsys):
    from sae_env import precompile
    monkeypatch.setattr(precompile.fast_engine, "AVAILABLE", False)
    assert precompile.main([]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "numba" in err
