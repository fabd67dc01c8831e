"""The start-up phases (hpctrain/telemetry/startup.py): from the process's start, then mark
to mark; the launch before it when the launcher's start is known; the slowest rank's."""

import time

from hpctrain.telemetry import startup


def test_process_start_is_this_process():
    import subprocess
    import sys

    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); from hpctrain."
                          "telemetry.startup import process_start; print(process_start())"],
                         capture_output=True, text=True, check=True).stdout
    assert t0 - 0.05 <= float(out) <= t0 + 0.3  # started after t0, before its sleep ended


def test_phases_run_from_the_launch_and_the_process_start_mark_to_mark():
    begun = startup.process_start()
    startup.note("python")
    startup._FIRST[0] = True  # as in a fresh process
    s = startup.Startup(launched=begun - 0.5)
    assert [p for p, _ in s.marks] == ["python"] and not startup._EARLY
    s.mark("entry")
    time.sleep(0.05)
    s.mark("model")
    phases = s.phases()
    assert list(phases) == ["launch", "python", "entry", "model"]
    assert abs(phases["launch"] - 0.5) < 1e-3 and 0.05 <= phases["model"] < 1
    ends = [t for _, t in s.marks]
    assert abs(sum(phases.values()) - (ends[-1] - begun + 0.5)) < 1e-3
    later = startup.Startup(launched=begun)  # a second run in this process
    later.mark("entry")
    later.mark("model")
    assert list(later.phases()) == ["model"]


def test_report_takes_the_slowest_rank_per_phase():
    slowest, line = startup.report([{"python": 1.0, "model": 0.2}, {"python": 0.5, "model": 0.4}])
    assert slowest == {"python": 1.0, "model": 0.4}
    assert line.startswith("start-up to the end of the first step: 1.4 s") and "model 0.40" in line


def test_the_command_exits_with_mains_status_and_leaves_its_objects_to_the_exit(monkeypatch):
    """``program`` (the console script, ``python -m hpctrain``) exits with ``main``'s status
    and freezes what is alive out of the garbage collector's last pass."""
    import gc

    import pytest

    import hpctrain.__main__ as entry

    monkeypatch.setattr(entry, "main", lambda: 3)
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit) as e:
            entry.program()  # finish(main())
        assert e.value.code == 3 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_console_script_is_the_program():
    import configparser
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parents[2] / "setup.cfg")
    assert cfg["options.entry_points"]["console_scripts"].split() == [
        "hpctrain", "=", "hpctrain.__main__:program"]


def test_a_refused_train_leaves_the_collector_on(tmp_path, capsys):
    """``hpctrain train`` called in a process that goes on (a refusal returns 2): the
    collector it turned off for its imports is on again."""
    import gc

    from hpctrain.__main__ import main

    assert main(["train", str(tmp_path / "missing.toml"), "--run-dir", str(tmp_path / "r")]) == 2
    assert gc.isenabled()
