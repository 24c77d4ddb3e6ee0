"""The command line every bench shares (--quick, --json FILE) and the rule that a failed run
is an error: an iperf3 run that fails never becomes a 0 Gbit/s row, and a bench that hits
an error exits non-zero with one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import (
    BenchError,
    int_list,
    iperf3_result,
    json_target,
    judged,
    parse_bench_args,
    run_main,
    write_json,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int_list, default=[10000, 100000])
    p.add_argument("--seconds", type=float, default=10.0)
    return p


QUICK = {"n": [1000], "seconds": 2.0}


def test_defaults_without_quick():
    args = parse_bench_args(parser(), [], name="x", quick=QUICK)
    assert (args.n, args.seconds, args.quick, args.json) == ([10000, 100000], 10.0, False, None)


def test_quick_replaces_the_defaults_but_explicit_options_win():
    args = parse_bench_args(parser(), ["--quick"], name="x", quick=QUICK)
    assert (args.n, args.seconds, args.quick) == ([1000], 2.0, True)
    args = parse_bench_args(parser(), ["--seconds", "5", "--quick"], name="x", quick=QUICK)
    assert (args.n, args.seconds) == ([1000], 5.0)


def test_help_names_the_quick_sizes(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_bench_args(parser(), ["--help"], name="x", quick=QUICK)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "n [1000]" in out and "--json FILE" in out


def test_json_file_and_directory(tmp_path):
    file = tmp_path / "out.json"
    assert parse_bench_args(parser(), ["--json", str(file)], name="x", quick=QUICK).json == str(file)
    assert parse_bench_args(parser(), ["--json", str(tmp_path)], name="services", quick=QUICK).json == str(
        tmp_path / "services.json")
    write_json(str(file), {"rows": [1, 2]})
    assert json.loads(file.read_text()) == {"rows": [1, 2]}
    write_json(None, {"ignored": True})  # no --json: nothing written


def test_json_to_a_path_that_cannot_be_written_is_one_usage_line(tmp_path, capsys):
    with pytest.raises(BenchError, match="No such file or directory"):
        json_target(str(tmp_path / "missing" / "out.json"), "x")
    with pytest.raises(SystemExit) as exc:
        parse_bench_args(parser(), ["--json", str(tmp_path / "missing" / "out.json")], name="x", quick=QUICK)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--json" in err and "Traceback" not in err


def test_unknown_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_bench_args(parser(), ["--rows", "3"], name="x", quick=QUICK)
    assert exc.value.code == 2


IPERF_OK = {"start": {}, "end": {"sum_sent": {"bits_per_second": 9.5e9, "retransmits": 3},
                                 "sum_received": {"bits_per_second": 9.4e9}}}


def test_iperf3_clean_run():
    run = iperf3_result(0, json.dumps(IPERF_OK).encode(), b"", "vip")
    assert run.gbps == pytest.approx(9.4) and run.retransmits == 3


@pytest.mark.parametrize(("rc", "stdout", "stderr", "reason"), [
    # the server not listening: iperf3 -J reports the error in its JSON and exits 1
    (1, json.dumps({"start": {}, "end": {}, "error": "unable to connect to server: Connection refused"}), "",
     "Connection refused"),
    # an error with a partial report (the connection reset mid-run)
    (1, json.dumps({**IPERF_OK, "error": "control socket has closed unexpectedly"}), "", "closed unexpectedly"),
    (0, json.dumps({"start": {}, "end": {}, "error": "interrupt - the client has terminated"}), "", "interrupt"),
    (2, "", "iperf3: parameter error - must either be a client (-c) or server (-s)", "parameter error"),
    (124, "{ \"start\": {", "", "exit 124"),  # killed mid-report
    (1, json.dumps(IPERF_OK), "something broke", "something broke"),  # exit status alone decides too
    (0, json.dumps({"start": {}, "end": {}}), "", "no received total"),
    (0, json.dumps({"end": {"sum_received": {"bits_per_second": 0}}}), "", "moved no data"),
])
def test_iperf3_failure_is_an_error_not_zero(rc, stdout, stderr, reason):
    with pytest.raises(BenchError, match=reason) as exc:
        iperf3_result(rc, stdout, stderr, "direct, round 2")
    assert str(exc.value).startswith("direct, round 2: ")


def test_run_main_turns_a_failed_run_into_exit_1_and_one_line(capsys):
    def failing() -> int:
        raise BenchError("vip: iperf3 failed (exit 1): unable to connect")

    with pytest.raises(SystemExit) as exc:
        run_main(failing, "bench/services.py")
    assert exc.value.code == 1
    assert capsys.readouterr().err == "bench/services.py: vip: iperf3 failed (exit 1): unable to connect\n"

    class LabError(Exception):
        pass

    def lab_failed() -> int:
        raise LabError("etcd did not start")

    with pytest.raises(SystemExit) as exc:
        run_main(lab_failed, "bench/x.py", errors=(LabError,))
    assert exc.value.code == 1


def test_run_main_passes_the_exit_status_through():
    for returned, code in ((0, 0), (None, 0), (3, 3)):
        with pytest.raises(SystemExit) as exc:
            run_main(lambda r=returned: r, "bench/x.py")
        assert exc.value.code == code


def test_run_main_other_exceptions_are_not_hidden():
    def bug() -> int:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        run_main(bug, "bench/x.py")


def test_run_main_ends_quietly_on_a_closed_pipe_as_agentd_does():
    """`bench/x.py | head`, head gone: exit status 141 (128 + SIGPIPE), nothing on stderr."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    code = "from bench._common import run_main\nrun_main(lambda: print('row ' * 50_000), 'bench/x.py')\n"
    try:
        r = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, ""), r


@pytest.mark.parametrize("value, goal, at_least, decimals, shown", [
    (0.9496, 0.95, True, 3, ("0.9496x", "NOT met")),  # 0.950x beside NOT met before
    (0.94996, 0.95, True, 3, ("0.94996x", "NOT met")),
    (0.946, 0.95, True, 3, ("0.946x", "NOT met")),
    (0.95, 0.95, True, 3, ("0.950x", "met")),
    (0.95004, 0.95, True, 3, ("0.950x", "met")),  # met: the goal itself may be what it prints
    (0.9496, 0.9498, True, 3, ("0.9496x", "NOT met")),  # 0.950x would read as above the goal
    (1.004, 1.0, False, 2, ("1.004x", "NOT met")),  # an at-most goal (RSS): 1.00x before
    (0.996, 1.0, False, 2, ("1.00x", "met")),
    (2.5, 1.0, False, 2, ("2.50x", "NOT met")),
])  # fmt: skip
def test_a_value_that_misses_its_goal_never_prints_as_the_goal(value, goal, at_least, decimals, shown):
    assert judged(value, goal, at_least=at_least, decimals=decimals) == shown


@pytest.mark.parametrize("value, goal, decimals, unit, shown", [
    (999.6, 1000, 0, " ms", ("999.6 ms", "met")),  # 1000 ms beside "met" for a goal of < 1000 before
    (1000.0, 1000, 0, " ms", ("1000 ms", "NOT met")),  # the goal itself misses a strict goal
    (0.9996, 1, 3, " s", ("0.9996 s", "met")),
    (1.0004, 1, 3, " s", ("1.000 s", "NOT met")),  # the goal itself misses it too
])  # fmt: skip
def test_a_strict_goal_below_a_value_is_judged_and_printed_apart_from_it(value, goal, decimals, unit, shown):
    assert judged(value, goal, at_least=False, strict=True, decimals=decimals, unit=unit) == shown
