"""Serving on Ray Serve: one base model per deployment with many tenants' LoRA adapters.

Its surface is ``app`` (the deployment, which ``tunefleet.workers.backend`` starts by its
import path). The rest is the package's own: the batched engine (``_engine``, ``_kvcache``,
``_generate``, ``_structured``), the batched LoRA layers (``_multilora``, ``_onednn``),
adapters and their cache (``_adapters``, ``_adapter_cache``), OpenAI's request shapes and
answers (``_openai_api``, ``_answer``, ``_responses``) and metrics (``_metrics``).
"""
