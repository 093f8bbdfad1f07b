"""Tenants' tracking spaces (``spec.TrackingSpaces``, from Settings' templates): names
placed under the tenant's, an entity other than the operator's refused, and templates
that would let tenants share a space refused at start-up, naming the setting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tunefleet.platform.settings import Settings
from tunefleet.platform.spec import Integration, MlflowOptions, TrackingSpaces, WandbOptions


def test_an_entity_per_tenant_and_a_prefix_per_tenant() -> None:
    spaces = Settings(
        wandb_entity_template="{tenant}-ml",
        wandb_project_template="{project}",
        mlflow_experiment_template="tenants/{tenant}/{experiment}",
    ).tracking_spaces
    wandb = Integration(type="wandb", wandb=WandbOptions(project="p"))
    placed = spaces.place(wandb, "acme").wandb
    assert placed is not None and (placed.entity, placed.project) == ("acme-ml", "p")
    own = Integration(type="wandb", wandb=WandbOptions(project="p", entity="acme-ml"))
    assert spaces.place(own, "acme").wandb == placed  # its own entity, named: accepted
    other = Integration(type="wandb", wandb=WandbOptions(project="p", entity="globex-ml"))
    with pytest.raises(ValueError, match="TUNEFLEET_WANDB_ENTITY_TEMPLATE"):
        spaces.place(other, "acme")
    mlflow = Integration(type="mlflow", mlflow=MlflowOptions(experiment_name="runs"))
    placed_mlflow = spaces.place(mlflow, "acme").mlflow
    assert placed_mlflow is not None and placed_mlflow.experiment_name == "tenants/acme/runs"
    assert TrackingSpaces() == Settings().tracking_spaces


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("mlflow_experiment_template", "{experiment}", "must hold {tenant}"),
        ("wandb_project_template", "{project}", "must hold {tenant}"),
        ("mlflow_experiment_template", "{tenant}/{job}", "may hold only {experiment} and {tenant}"),
        ("wandb_entity_template", "{project}", "may hold only {tenant}"),
    ],
)
def test_templates_that_share_a_space_are_refused_naming_the_setting(
    setting: str, value: str, says: str
) -> None:
    with pytest.raises(ValidationError) as e:
        Settings(**{setting: value})
    assert f"TUNEFLEET_{setting.upper()}" in str(e.value) or "TUNEFLEET_WANDB" in str(e.value)
    assert says in str(e.value)
