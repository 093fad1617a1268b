"""The dispatcher's gate on gold validation: instances whose image has no valid record are excluded with a
warning each, or the run is refused, before anything is written."""

from pathlib import Path

import pytest

from dispatcher.plan import apply_validation, make_plan
from dispatcher.spec import SpecError, load_spec
from tests.e2e.test_local_run import without_gateway

ROOT = Path(__file__).resolve().parents[2]


def spec_with(tmp_path, policy: str):
    text = without_gateway((ROOT / "examples/local.toml").read_text())
    text = text.replace('"synthetic/', f'"{ROOT}/examples/synthetic/')
    text = text.replace("[eval]", f'[eval]\nrequire_validated = "{policy}"')
    p = tmp_path / "spec.toml"
    p.write_text(text)
    return make_plan(load_spec(p))


@pytest.fixture
def records(pg):
    """calc-2 valid, textkit-1 invalid (broken image), the rest never validated."""
    ids = ["evalplane__calc-2", "evalplane__textkit-1"]
    pg.execute("DELETE FROM image_validations WHERE instance_id LIKE 'evalplane__%%'")
    plan = make_plan(load_spec(ROOT / "examples/local.toml"))
    for iid, valid in zip(ids, (True, False)):
        pg.execute("INSERT INTO image_validations (image, digest, instance_id, valid, reason) VALUES (%s, %s, %s, %s, %s)",
                   (plan.rows[iid]["image"], f"sha256:{iid}", iid, valid, None if valid else "gold patch did not resolve"))
    pg.commit()
    yield
    pg.execute("DELETE FROM image_validations WHERE instance_id = ANY(%s)", (ids,))
    pg.commit()


def test_exclude_keeps_only_validated_instances_and_warns(tmp_path, pg, records):
    plan, warnings = apply_validation(spec_with(tmp_path, "exclude"), pg)
    assert list(plan.rows) == ["evalplane__calc-2"]
    assert [r.instance_id for r in plan.refs] == ["evalplane__calc-2"]
    assert len(warnings) == 4
    assert any("evalplane__textkit-1" in w and "gold patch did not resolve" in w for w in warnings)
    assert any("evalplane__calc-1" in w and "never validated" in w for w in warnings)


def test_refuse_names_the_field_and_the_instances(tmp_path, pg, records):
    with pytest.raises(SpecError) as e:
        apply_validation(spec_with(tmp_path, "refuse"), pg)
    assert e.value.problems[0].path == "eval.require_validated"
    assert "4 instance image(s)" in e.value.problems[0].message


def test_off_runs_everything(tmp_path, pg, records):
    plan, warnings = apply_validation(spec_with(tmp_path, "off"), pg)
    assert len(plan.rows) == 5 and warnings == []
