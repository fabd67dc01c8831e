"""One fault injector: the config and the environment feed the same list (hpctrain.faults);
a wrong item is a config error; the checkpoint code asks the injector, not variables of its
own. (Each kind acting in a real run: tests/e2e/test_faults.py, test_checkpoint*.py,
test_local_tiers.py.)"""

import pytest
from launch import TINY

from hpctrain import faults
from hpctrain.checks.validate import validate
from hpctrain.config import ConfigError, load
from hpctrain.telemetry.fault_injection import Faults

SPEC = "kill@1:3;ckpt_kill@0:4;ckpt_slow@*:*:1.5;local_kill@2:*"


def test_config_and_environment_forms_are_one_list(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    from_config = faults.parse(faults.spec(SPEC))
    monkeypatch.setenv(faults.ENV, SPEC)
    from_env = faults.parse(faults.spec(""))
    assert from_config == from_env == [
        faults.Fault("kill", 1, 3), faults.Fault("ckpt_kill", 0, 4),
        faults.Fault("ckpt_slow", None, None, 1.5), faults.Fault("local_kill", 2, None)]
    assert len(faults.parse(faults.spec("raise@0:1"))) == 5  # both forms are read


def test_find_matches_rank_step_and_wildcards(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.install(SPEC)
    assert faults.find("ckpt_kill", 0, 4) and not faults.find("ckpt_kill", 1, 4)
    assert not faults.find("ckpt_kill", 0, 5)
    assert faults.find("ckpt_slow", 7, 99).seconds == 1.5
    assert faults.find("local_kill", 2, 1) and not faults.find("local_kill", 1, 1)
    in_step = Faults("", 1)  # installs the environment's alone (none): nothing fires
    assert not in_step and faults.find("ckpt_kill", 0, 4) is None


def test_environment_alone_reaches_a_checkpoint_written_outside_a_run(monkeypatch):
    monkeypatch.setattr(faults, "_INSTALLED", [])
    monkeypatch.setenv(faults.ENV, "ckpt_fail@3:2")
    assert faults.find("ckpt_fail", 3, 2) and not faults.find("ckpt_fail", 3, 1)


@pytest.mark.parametrize("item,message", [
    ("boom@1:2", "unknown kind 'boom'"),
    ("kill@1", "expected KIND@RANK:STEP"),
    ("kill@x:2", "expected KIND@RANK:STEP"),
])
def test_a_wrong_item_is_a_config_error_in_either_form(monkeypatch, item, message):
    monkeypatch.delenv(faults.ENV, raising=False)
    with pytest.raises(ConfigError, match=f"experimental.faults / \\$HPCTRAIN_FAULTS: .*{message}"):
        validate(load(TINY, [f'experimental.faults="{item}"']), 1)
    monkeypatch.setenv(faults.ENV, item)
    with pytest.raises(ConfigError, match=message):
        validate(load(TINY), 1)
