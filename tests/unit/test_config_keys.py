"""The keys' own metadata (``hpctrain.config.key``): every key has a meaning, its declared
rule refuses what it should with the usual message, docs/config.md is generated from it; the
keys that moved to ``[experimental]`` are still read under their old names; the CLIs' help
points at the reference."""

import contextlib
import dataclasses
import io
from pathlib import Path

import pytest

from hpctrain.__main__ import main
from hpctrain.checks.keys import REGENERATE, key_problems, markdown, rule_problem
from hpctrain.config import LEGACY, Config, ConfigError, dumps_toml, from_dict, load, toml_key

ROOT = Path(__file__).resolve().parents[2]
KEYS = [(s.name, f) for s in dataclasses.fields(Config)
        for f in dataclasses.fields(s.default_factory())]


def test_docs_config_md_is_generated_from_the_keys():
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert text == markdown(), f"docs/config.md is stale; regenerate it: {REGENERATE}"


def test_every_key_has_a_meaning_in_the_reference():
    doc = markdown()
    for section, f in KEYS:
        assert f.metadata.get("help"), f"{section}.{f.name} has no help text"
        assert f"| `{toml_key(f.name)}` |" in doc
    for section in (s.name for s in dataclasses.fields(Config)):
        assert f"## [{section}]" in doc
    assert "not for production" in doc and "`optim.reduction` | `experimental.reduction`" in doc


def _breaking(meta, default):
    """A value of the key's type that breaks its declared rule."""
    if meta["choices"]:
        return "nope" if isinstance(default, str) else max(meta["choices"]) + 1
    if meta["ge"] is not None:
        return type(default)(meta["ge"] - 1)
    if meta["gt"] is not None:
        return type(default)(meta["gt"])
    lo, hi = meta["within"]
    return type(default)(hi) if isinstance(default, float) else lo - 1


@pytest.mark.parametrize("section,f", [(s, f) for s, f in KEYS
                                       if any(f.metadata.get(k) not in (None, ())
                                              for k in ("choices", "ge", "gt", "within"))],
                         ids=lambda x: x if isinstance(x, str) else x.name)
def test_each_declared_rule_refuses_a_value_with_the_key_in_the_message(section, f):
    cfg = Config()
    body = getattr(cfg, section)
    bad = _breaking(f.metadata, getattr(body, f.name))
    broken = dataclasses.replace(cfg, **{section: dataclasses.replace(body, **{f.name: bad})})
    name = f"{section}.{toml_key(f.name)}"
    found = key_problems(broken)
    assert len(found) == 1 and found[0].startswith(f"{name}={bad!r}"), found


def test_defaults_break_no_declared_rule():
    assert key_problems(Config()) == []


@pytest.mark.parametrize("value", [0, 0.0, -0.0, 0, -1e-9, 0.0])
def test_a_section_seen_before_reads_as_given(value):
    """key_problems keeps each section's answer (a search judges many configs): a value
    equal to one seen before but written otherwise (0, 0.0, -0.0) is still shown as given,
    and the answer is the one the rules give afresh."""
    cfg = Config()
    body = dataclasses.replace(cfg.model, norm_eps=value)
    found = key_problems(dataclasses.replace(cfg, model=body))
    assert found == [rule_problem("model.norm_eps", value, {"gt": 0})]
    assert found == [f"model.norm_eps={value!r} must be > 0"]


@pytest.mark.parametrize("value,rule,message", [
    ("x", {"choices": ("a", "b")}, "k.v='x'; valid: a, b"),
    (4, {"choices": (0, 1, 2, 3)}, "k.v=4 must be 0, 1, 2 or 3"),
    (-1, {"ge": 0}, "k.v=-1 must be >= 0"),
    (0.0, {"gt": 0}, "k.v=0.0 must be > 0"),
    (1.0, {"within": (0, 1)}, "k.v=1.0 must be in [0, 1)"),
    (-1, {"within": (0, 2**63)}, "k.v=-1 must be in [0, 2**63)"),
    (0, {"within": (0, 1)}, None),
])
def test_rule_messages(value, rule, message):
    assert rule_problem("k.v", value, rule) == message


OLD = {"optim": {"reduction": "per-parameter"}, "topology": {"placement": "naive", "dp": 2},
       "schedule": {"p2p_wait": "spin"}, "telemetry": {"faults": "kill@1:3"}}


def test_legacy_keys_of_stored_configs_are_read_under_their_new_names():
    cfg = from_dict(OLD)
    e = cfg.experimental
    assert (e.reduction, e.placement, e.p2p_wait, e.faults) == \
        ("per-parameter", "naive", "spin", "kill@1:3")
    assert cfg.topology.dp == 2
    text = dumps_toml(cfg)  # written back under the new names only
    assert "[experimental]" in text and "placement" not in text.split("[experimental]")[0]
    assert OLD["optim"] == {"reduction": "per-parameter"}  # the caller's dict is not changed
    assert set(LEGACY) == {f"{s}.{k}" for s, body in OLD.items() for k in body} - {"topology.dp"}


def test_old_presets_and_overrides_load_and_the_later_setting_wins(tmp_path):
    p = tmp_path / "old.toml"
    p.write_text('[optim]\nreduction = "per-parameter"\n[schedule]\np2p_wait = "spin"\n')
    cfg = load(p, ['topology.placement="naive"', 'experimental.p2p_wait="yield"'])
    e = cfg.experimental
    assert (e.reduction, e.placement, e.p2p_wait) == ("per-parameter", "naive", "yield")
    assert load(p, ['optim.reduction="bucketed"']).experimental.reduction == "bucketed"
    both = {"optim": {"reduction": "per-parameter"},
            "experimental": {"reduction": "bucketed-nonblocking"}}
    assert from_dict(both).experimental.reduction == "bucketed-nonblocking"


def test_a_wrong_value_under_an_old_name_is_refused_under_the_new_name():
    with pytest.raises(ConfigError, match="experimental.p2p_wait must be a string"):
        load(None, ["schedule.p2p_wait=[3]"])


def _help(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(out.getvalue().split())


def test_train_help_points_to_the_reference():
    assert "docs/config.md" in _help("train")


def test_plan_help_describes_its_modes():
    text = _help("plan")
    for mode in ("--cluster", "--search", "--calibrate", "--published", "docs/config.md"):
        assert mode in text.split("positional arguments")[0], mode


def test_plan_does_not_import_the_train_cli():
    src = (ROOT / "hpctrain" / "cli" / "plan.py").read_text(encoding="utf-8")
    assert "from .train" not in src and "cli.train" not in src
