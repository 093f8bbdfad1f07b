"""What a serving replica reserves on its Ray node."""

from __future__ import annotations

from pathlib import Path

from tunefleet.workers.serve.app import build_app


def test_a_replica_reserves_the_memory_of_its_base_weights(tiny_registry: Path) -> None:
    """A node that holds replicas is never idle to Ray's autoscaler, which removes only
    idle nodes: the replica reserves Ray's ``memory`` resource for its weights (no CPU,
    which training jobs are placed by)."""
    model = tiny_registry / "tiny-llama"
    app = build_app(base_model="tiny-llama", model_path=str(model), store={}, secret="s")
    options = app._bound_deployment.ray_actor_options
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    assert weights > 0 and options["memory"] == weights
    assert options["num_cpus"] == 0
