from __future__ import annotations

from pathlib import Path

import pytest

from testbed.config.overrides import overrides_for
from testbed.config.scenarios import ScenarioError, load_scenario

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("name", ["paper-prfaas", "paper-homogeneous", "paper-naive"])
def test_paper_scenarios_load(name: str) -> None:
    sc = load_scenario(name)
    assert sc.name == name
    assert sc.workload.input.mu == 9.90 and sc.workload.output_tokens == 1024


def test_paper_deployments_match_table6() -> None:
    p = load_scenario("paper-prfaas")
    assert [(c.kind, c.hardware, c.prefill, c.decode) for c in p.clusters] == [
        ("prfaas", "h200", 4, 0),
        ("pd", "h20", 3, 5),
    ]
    assert p.policy.threshold == 19400
    h = load_scenario("paper-homogeneous")
    assert [(c.prefill, c.decode) for c in h.clusters] == [(9, 3)]
    n = load_scenario("paper-naive")
    assert [(c.prefill, c.decode) for c in n.clusters] == [(4, 0), (0, 8)]


def _write(tmp_path: Path, text: str) -> Path:
    base = Path(__file__).resolve().parent.parent / "scenarios" / "base" / "paper.yaml"
    f = tmp_path / "bad.yaml"
    f.write_text(f"extends: {base}\n" + text)
    return f


def test_invalid_field_names_file_and_field(tmp_path: Path) -> None:
    f = _write(
        tmp_path,
        "name: x\nclusters:\n  - {name: pd, datacenter: a, kind: pd, hardware: h20, prefill: -1, decode: 2}\n"
        "policy: {name: homogeneous}\n",
    )
    with pytest.raises(ScenarioError) as e:
        load_scenario(f)
    assert str(f) in str(e.value) and "clusters.0.prefill" in str(e.value)


def test_unknown_field_rejected(tmp_path: Path) -> None:
    f = _write(tmp_path, "name: x\nclusters: []\npolicy: {name: homogeneous}\nscael: {speedup: 2}\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(f)
    assert "scael" in str(e.value) and "clusters" in str(e.value)


def test_cross_field_errors(tmp_path: Path) -> None:
    f = _write(
        tmp_path,
        "name: x\nclusters:\n  - {name: pd, datacenter: a, kind: pd, hardware: tpu, prefill: 1, decode: 1}\n"
        "policy: {name: homogeneous}\n",
    )
    with pytest.raises(ScenarioError, match="names hardware 'tpu'"):
        load_scenario(f)
    f = _write(
        tmp_path,
        "name: x\nclusters:\n  - {name: pd, datacenter: a, kind: pd, hardware: h20, prefill: 1, decode: 1}\n"
        "policy: {name: prfaas, threshold: 100}\n",
    )
    with pytest.raises(ScenarioError, match="needs a 'prfaas' cluster"):
        load_scenario(f)


def test_bad_yaml_and_missing(tmp_path: Path) -> None:
    f = tmp_path / "broken.yaml"
    f.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(f)
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario("no-such-scenario")


def test_overrides() -> None:
    ov = overrides_for("paper-prfaas", ["scale.speedup=8", "policy.threshold=30000"])
    sc = load_scenario("paper-prfaas", ov)
    assert sc.scale.speedup == 8 and sc.policy.threshold == 30000
    with pytest.raises(ScenarioError, match="field.path=value"):
        overrides_for("paper-prfaas", ["nonsense"])


def test_overrides_address_list_items_by_index() -> None:
    ov = overrides_for("paper-prfaas", ["clusters.1.prefill=2"])
    sc = load_scenario("paper-prfaas", ov)
    assert sc.clusters[1].prefill == 2
    assert [c.name for c in sc.clusters] == [c.name for c in load_scenario("paper-prfaas").clusters]
    with pytest.raises(ScenarioError, match=r"index 7 out of range \(the list has 2 elements\)"):
        overrides_for("paper-prfaas", ["clusters.7.prefill=2"])


def test_a_bad_set_value_is_a_scenario_error_not_a_yaml_traceback() -> None:
    with pytest.raises(ScenarioError, match=r"--set 'scale.speedup=\[1': the value is not valid YAML"):
        overrides_for("paper-prfaas", ["scale.speedup=[1"])


def test_an_unknown_link_profile_fails_at_load_naming_the_field() -> None:
    from testbed.config import ProfileError, load

    with pytest.raises(
        ProfileError, match=r"paper-prfaas.yaml: field 'links.inter_dc': link profile 'nowhere-9g' not found"
    ):
        load("paper-prfaas", {"links": {"inter_dc": "nowhere-9g"}})


def test_extends_list_merges_left_to_right(tmp_path: Path) -> None:
    scen = Path(__file__).resolve().parent.parent / "scenarios"
    a = tmp_path / "a.yaml"
    a.write_text("scale: {speedup: 2, byte_scale: 64}\nslo: {ttft_s: 5.0}\n")
    b = tmp_path / "b.yaml"
    b.write_text("scale: {speedup: 3}\n")
    f = tmp_path / "x.yaml"
    f.write_text(f"extends: [{scen / 'paper-prfaas.yaml'}, a.yaml, b.yaml]\nname: x\nslo: {{tpot_s: 0.05}}\n")
    sc = load_scenario(f)
    # Later parents win field by field; the file itself wins over all of them.
    assert (sc.scale.speedup, sc.scale.byte_scale) == (3, 64)
    assert (sc.slo.ttft_s, sc.slo.tpot_s) == (5.0, 0.05)
    assert sc.policy.threshold == 19400 and sc.name == "x"


def test_extends_must_name_files(tmp_path: Path) -> None:
    for bad in ("[]", "{a: 1}", "[paper.yaml, 3]"):
        f = tmp_path / "x.yaml"
        f.write_text(f"extends: {bad}\nname: x\n")
        with pytest.raises(ScenarioError, match="'extends' must be a file name or a list"):
            load_scenario(f)
    f = tmp_path / "y.yaml"
    f.write_text("extends: [no-such-parent.yaml]\nname: y\n")
    with pytest.raises(ScenarioError, match="no-such-parent.yaml: cannot read"):
        load_scenario(f)
