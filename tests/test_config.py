"""Configs: validation, profiles, and the same field names on the command line and in MLflow params."""

import json

import pytest
from pydantic import ValidationError

from tasks.cli import parse_config
from tasks.config import MergeConfig, OPDConfig, WorldConfig, flatten, pipeline_config
from tasks.tracking.runs import config_params


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: OPDConfig(lr=0), "greater than 0"),
        (lambda: OPDConfig(batch_size=0), "greater than or equal to 1"),
        (lambda: OPDConfig(sample_temperature=-1), "greater than 0"),
        (lambda: WorldConfig(routes=["shift-medium"]), "unknown budget"),
        (lambda: WorldConfig(routes=["mul-low"]), "unknown domain"),
        (lambda: WorldConfig(routes=[]), "at least one route"),
        (lambda: WorldConfig(min_len={"shift": 5, "rev": 3, "sort": 3}, max_len={"shift": 2, "rev": 8, "sort": 8}), "min_len"),
        (lambda: MergeConfig(unknown_field=1), "Extra inputs"),
    ],
)
def test_out_of_range_values_are_refused(make, match):
    with pytest.raises(ValidationError, match=match):
        make()


def test_quick_profile_is_smaller_and_valid():
    quick, default = pipeline_config("quick"), pipeline_config("default")
    assert quick.profile == "quick" and len(quick.world.routes) < len(default.world.routes)
    assert quick.opd.steps < default.opd.steps
    assert len(default.world.routes) >= 6


def test_cli_flags_are_the_dotted_field_names_and_mlflow_params_match():
    cfg = parse_config(["--profile", "quick", "--opd.steps", "7", "--world.routes", "shift-low,rev-high"],
                       pipeline_config, "t", with_profile=True)
    assert cfg.opd.steps == 7 and cfg.world.routes == ["shift-low", "rev-high"] and cfg.profile == "quick"
    assert cfg.model.hidden_size == pipeline_config("quick").model.hidden_size
    params = config_params(cfg)
    assert params["opd.steps"] == "7"
    assert json.loads(params["world.routes"]) == ["shift-low", "rev-high"]
    assert set(params) == set(flatten(cfg))
    with pytest.raises(SystemExit, match="opd.lr"):
        parse_config(["--opd.lr", "-1"], pipeline_config, "t", with_profile=True)


def test_route_normalization_and_route_sampling_are_validated():
    from tasks.config import OPDConfig

    assert OPDConfig(route_normalization="label:domain").route_normalization == "label:domain"
    for bad in ("bogus", "label:", "routes"):
        with pytest.raises(ValueError, match="expected none, route or label:KEY"):
            OPDConfig(route_normalization=bad)
    with pytest.raises(ValueError, match="route_normalization: each process would measure"):
        OPDConfig(route_normalization="route", nproc=2)
    with pytest.raises(ValueError):
        OPDConfig(route_sampling="weighted")
    with pytest.raises(ValueError):
        OPDConfig(route_sampling_floor=1.5)


def test_default_world_specialists_learn_to_recover_and_the_quick_and_real_profiles_keep_gold_rows():
    """recovery_noise 0.3 is the default specialists' recipe (measured on the default world: mean retention 0.931 ->
    0.953); the quick and real profiles, where it was not measured, keep 0."""
    from tasks.config import SpecialistsConfig, pipeline_config

    assert SpecialistsConfig().train.recovery_noise == 0.3
    assert pipeline_config("default").specialist_train.recovery_noise == 0.3
    assert pipeline_config("default").specialists("base").train.recovery_noise == 0.3
    assert pipeline_config("quick").specialist_train.recovery_noise == 0.0
    assert pipeline_config("real").specialist_train.recovery_noise == 0.0


def test_the_main_job_merges_in_two_stages_and_the_comparisons_start_plain():
    """cold_start_steps 100 is the merge's default (the default world's main job: mean retention 0.953 -> 0.977);
    the quick profile, the method benchmark and the objectives menu start plain, so their plain-OPD rows stay plain
    and only opd_two_stage / two_stage add the stage."""
    from flows.bench.benchmark import METHODS, benchmark_config
    from flows.objectives import VARIANTS, objectives_config
    from tasks.config import _deep_merge

    assert pipeline_config("default").opd.cold_start_steps == 100
    assert MergeConfig().opd.cold_start_steps == 100
    assert pipeline_config("quick").opd.cold_start_steps == 0
    assert pipeline_config("real").opd.cold_start_steps == 120
    for profile in ("default", "quick"):
        bench = benchmark_config(profile)
        assert bench.opd.cold_start_steps == 0
        assert _deep_merge(bench.opd.model_dump(), METHODS["opd_two_stage"]["opd"])["cold_start_steps"] == 100
        objectives = objectives_config(profile)
        assert objectives.opd.cold_start_steps == 0
        assert _deep_merge(objectives.opd.model_dump(), VARIANTS["two_stage"])["cold_start_steps"] == 100
    assert benchmark_config("default", opd={"cold_start_steps": 7}).opd.cold_start_steps == 7  # the user's word wins
