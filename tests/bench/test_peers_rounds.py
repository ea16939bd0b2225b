"""`kvtool bench peers` rounds: the alternating engine order, the median and spread over rounds, and when a run
counts as quiet (pure Python)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest

from kvtool.bench.peers import PeersConfig
from kvtool.bench.peers.harness import engine_row
from kvtool.bench.peers.rounds import (LoadMonitor, alternating_order, combine, figure, is_quiet, load_summary,
                                       set_phase, settle)
from kvtool.errors import InvalidParameterError


def _summary(values):
    values = sorted(values)
    return {"median": values[len(values) // 2], "min": values[0], "max": values[-1], "stdev": 0.0,
            "n": len(values), "runs": values}


def test_engines_run_forward_then_backward_each_round():
    order = alternating_order(["A", "B", "C", "D"], 2)
    assert [name for _, name in order] == list("ABCDDCBA")
    assert [r for r, _ in order] == [1] * 4 + [2] * 4
    assert "".join(name for _, name in alternating_order(["A", "B"], 3)) == "ABBAAB"
    assert alternating_order(["A"], 2) == [(1, "A"), (2, "A")]


def test_every_figure_is_the_median_of_the_rounds_with_their_spread():
    rounds = [{"decode_tok_s": _summary([10.0, 11.0, 12.0]), "streams_4": {"tok_s": _summary([5.0]), "itl_ms_p99": 40.0},
               "prefix_cached_tokens": 2048, "memory": {"rss_mib": 500.0, "processes": 1}, "layouts_isolation": "nonce"},
              {"decode_tok_s": _summary([20.0, 21.0, 22.0]), "streams_4": {"tok_s": _summary([7.0]), "itl_ms_p99": 30.0},
               "prefix_cached_tokens": 2032, "memory": {"rss_mib": 520.0, "processes": 1}, "layouts_isolation": "nonce"},
              {"decode_tok_s": _summary([30.0]), "streams_4": {"tok_s": _summary([6.0]), "itl_ms_p99": 50.0},
               "prefix_cached_tokens": 2040, "memory": {"rss_mib": 510.0, "processes": 2}, "layouts_isolation": "nonce"}]
    results, spread = combine(rounds)
    decode = results["decode_tok_s"]
    assert (decode["median"], decode["min"], decode["max"], decode["n"]) == (21.0, 11.0, 30.0, 3)
    assert decode["runs"] == [11.0, 21.0, 30.0]  # one value per round: that round's median
    assert results["streams_4"]["tok_s"]["median"] == 6.0 and results["streams_4"]["itl_ms_p99"] == 40.0
    assert spread["streams_4.itl_ms_p99"] == {"min": 30.0, "max": 50.0, "n": 3}
    assert results["prefix_cached_tokens"] == 2040 and isinstance(results["prefix_cached_tokens"], int)
    assert results["memory"] == {"rss_mib": 510.0, "processes": 1}
    assert results["layouts_isolation"] == "nonce"
    row = {"results": results, "spread": spread}
    assert figure(row, "memory.rss_mib") == (510.0, 500.0, 520.0)
    assert figure(row, "decode_tok_s") == (21.0, 11.0, 30.0)
    assert figure(row, "layouts_isolation") is None and figure(row, "nothing.here") is None


def test_figures_a_round_lacks_come_from_the_rounds_that_have_them():
    results, spread = combine([{"a": 1.0, "p": None}, {"a": 3.0, "b": 5.0, "p": None}, {}])
    assert results == {"a": 2.0, "b": 5.0, "p": None} and spread["b"] == {"min": 5.0, "max": 5.0, "n": 1}
    assert combine([]) == ({}, {})


def test_quiet_only_when_every_sample_stays_at_or_below_the_core_count():
    assert is_quiet([0.5, 2.0, 1.9], cores=2)
    assert not is_quiet([0.5, 2.01, 1.0], cores=2)
    assert not is_quiet([], cores=2)  # nothing sampled: nothing shows the machine was quiet
    load = load_summary([1.0, 3.5, 0.8], cores=4)
    assert load == {"cores": 4, "first": 1.0, "last": 0.8, "min": 0.8, "max": 3.5, "samples": 3, "quiet": True}
    assert not load_summary([1.0, 4.5], cores=4)["quiet"]


def test_the_load_monitor_samples_on_entry_and_exit():
    with LoadMonitor(every_s=0.01) as load:
        pass
    assert len(load.samples) >= 2 and all(x >= 0 for x in load.samples)


def test_each_sample_carries_its_phase_and_the_summary_names_the_highest_in_each():
    set_phase("start-up")
    with LoadMonitor(every_s=3600) as load:
        set_phase("decode")
    set_phase("idle")
    assert load.phases == ["start-up", "decode"]
    summary = load_summary([1.0, 2.5, 0.5, 1.5], cores=2, phases=["start-up", "start-up", "decode", "decode"])
    assert summary["max_by_phase"] == {"start-up": 2.5, "decode": 1.5} and not summary["quiet"]
    assert load_summary([1.0, 1.2], cores=2, others=[0.05, 0.31])["others_cpu_max"] == 0.31


BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 3: pass"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU times come from /proc")
def test_cpu_of_processes_outside_the_run_is_told_apart_from_the_runs_own():
    """A busy child of this process is the run's own work (a server, a client); a busy process that is not
    this one's descendant (started detached: its shell exits, it is reparented) is other work."""
    with LoadMonitor(every_s=0.5) as own:
        subprocess.run([sys.executable, "-c", BUSY], check=True)
    with LoadMonitor(every_s=0.5) as other:
        subprocess.run(["sh", "-c", '"$0" -c "$1" &', sys.executable, BUSY], check=True)
        time.sleep(3)
    assert len(own.others) >= 4 and len(other.others) >= 4
    assert statistics.median(other.others) >= 0.5, other.others  # one core busy, outside the run
    assert statistics.median(own.others) < statistics.median(other.others) - 0.3, (own.others, other.others)


def test_settle_waits_for_the_load_to_fall_to_half_the_cores_and_no_longer_than_its_limit():
    loads, slept = iter([3.0, 2.0, 1.2, 0.9, 0.9]), []
    assert settle(2, _load=lambda: next(loads), _sleep=slept.append) == {"waited_s": 15.0, "load": 0.9}
    assert len(slept) == 3
    slept.clear()
    assert settle(2, max_wait_s=10, _load=lambda: 5.0, _sleep=slept.append) == {"waited_s": 10.0, "load": 5.0}
    assert settle(4, _load=lambda: 1.9, _sleep=slept.append)["waited_s"] == 0.0


def _run(rnd, decode, load_max, status="ok"):
    run = {"engine": "kvtool serve", "weights": "fp32", "budgets": {"kv": "2048 MiB"}, "status": status,
           "round": rnd, "seconds": 10.0, "startup_s": 5.0 + rnd,
           "load": load_summary([1.0, load_max], cores=2)}
    if status == "ok":
        run.update(results={"decode_tok_s": _summary([decode])}, unsupported={"layouts": "not measured"})
    else:
        run["reason"] = "it crashed"
    return run


def test_an_engine_entry_combines_its_runs_and_keeps_each_one():
    row = engine_row([_run(1, 10.0, 1.5), _run(2, 30.0, 2.5), _run(3, 20.0, 1.0)])
    assert row["status"] == "ok" and row["rounds"] == 3 and row["budgets"] == {"kv": "2048 MiB"}
    assert row["results"]["decode_tok_s"]["median"] == 20.0 and row["spread"]["decode_tok_s"]["max"] == 30.0
    assert row["startup_s"] == 7.0 and row["load_avg"] == [1.0, 2.5]
    assert [r["round"] for r in row["runs"]] == [1, 2, 3] and not row["runs"][1]["load"]["quiet"]
    assert row["unsupported"] == {"layouts": "not measured"}
    failed = engine_row([_run(1, 0, 1.0, status="failed"), _run(2, 12.0, 1.0)])
    assert failed["status"] == "ok" and failed["rounds"] == 1 and failed["runs"][0]["reason"] == "it crashed"
    assert engine_row([_run(1, 0, 1.0, status="failed")])["status"] == "failed"


def test_fewer_than_two_rounds_are_refused():
    with pytest.raises(InvalidParameterError, match="rounds"):
        PeersConfig(rounds=1).validate()
    assert PeersConfig(quick=True).sized().rounds == 2
