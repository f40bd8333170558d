"""``V17Strategy(zero=ZeroPolicy(overlap_comm=, prefetch_units=))``: validated by the ZeroPolicy, and warned
about where they cannot apply. That the policy reaches the engine and changes what runs is checked on 2 ranks by
``tests/dist/test_overlap.py`` (same flags through ``apply_fsdp`` / ``ZeroEngine``, as ``apply_zero_stage`` passes
them) and measured by ``bench/zero.py``'s ``v17_zero*_sync`` configurations."""

from __future__ import annotations

import warnings

import pytest

from lightning_v17.config import V17ConfigError, ZeroPolicy


def _strategy(**kw):
    from lightning_v17.strategies import V17Strategy

    return V17Strategy(**kw)


def test_overlap_options_reach_the_zero_policy() -> None:
    assert (_strategy().policy.zero.overlap_comm, _strategy().policy.zero.prefetch_units) == (True, 1)
    z = _strategy(zero=ZeroPolicy(stage=3, overlap_comm=False, prefetch_units=3)).policy.zero
    assert (z.overlap_comm, z.prefetch_units) == (False, 3)
    assert _strategy(zero=ZeroPolicy(stage=2, overlap_comm=False)).policy.zero.overlap_comm is False
    # the ZeRO options live in the one ZeroPolicy; its stage is given once (not also as zero_stage=)
    with pytest.raises(V17ConfigError, match="zero_stage=3 and zero=ZeroPolicy.*give the stage once"):
        _strategy(zero=ZeroPolicy(stage=3, prefetch_units=2), zero_stage=3)


def test_bad_prefetch_is_refused_and_prefetch_below_stage_3_warns() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(V17ConfigError, match=r"prefetch_units=.* must be an integer >= 0"):
            _strategy(zero=ZeroPolicy(prefetch_units=bad))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _strategy(zero=ZeroPolicy(stage=1, prefetch_units=2))
        _strategy(zero=ZeroPolicy(stage=3, prefetch_units=0))  # applies: no warning
    msgs = [str(w.message) for w in rec if "V17Strategy:" in str(w.message)]
    assert len(msgs) == 1 and "prefetch_units applies to zero_stage=3 only" in msgs[0], msgs
