"""What a serving replica reserves on its Ray node."""

from __future__ import annotations

from pathlib import Path

from tunefleet.workers.serve.app import ServingOptions, build_app


def test_a_replica_reserves_the_memory_of_its_base_weights_and_adapters(
    tiny_registry: Path,
) -> None:
    """A node that holds replicas is never idle to Ray's autoscaler, which removes only
    idle nodes, and a replica goes only where its memory fits: it reserves Ray's
    ``memory`` resource for its weights plus its adapters' budget (no CPU, which training
    jobs are placed by)."""
    model = tiny_registry / "tiny-llama"
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    assert weights > 0
    for budget in (None, 64 << 20):
        options = None if budget is None else ServingOptions(adapter_memory_bytes=budget)
        app = build_app(
            base_model="tiny-llama", model_path=str(model), store={}, secret="s", options=options
        )
        actor = app._bound_deployment.ray_actor_options
        assert actor["memory"] == weights + (budget or 4 << 30)  # 4 GiB by default
        assert actor["num_cpus"] == 0
