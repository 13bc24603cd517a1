"""batchbound.integrations: the online batch-size bound inside training loops batchbound does
not own, from what their steps already compute (McCandlish et al.'s two-batch estimator, no
per-example work). See docs/integrations.md.

- ``ddp``: a DistributedDataParallel communication hook for a user's own DDP loop.
- ``lightning``: ``DiversityCallback`` for a Lightning ``Trainer`` (``pip install
  batchbound[lightning]``).
- ``transformers``: ``DiversityCallback`` for a Hugging Face ``Trainer`` (``pip install
  batchbound[hf]``).

Nothing here is imported by ``import batchbound``; the framework modules import their
framework only when they are imported themselves.
"""
