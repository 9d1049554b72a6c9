"""pdserve inference engine: requests, paged KV cache, scheduler, model runner.

The engine knows nothing of Ray. Import submodules directly (``pdserve.engine.llm_engine``,
``pdserve.engine.scheduler``...); this package module stays import-light so that the scheduler and
the cache manager can be used (and tested) without importing torch.
"""
