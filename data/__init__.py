"""Token data for the trainer: the shard format (:mod:`data.shards`) and the scripts that produce shards.

- ``data/shards.py``: the one module that knows the on-disk format (header, validation, loading, globbing).
- ``data/loader.py``: the training batches' way to the device (``MicroBatch``, ``BackgroundLoader``), under
  train_gpt.py's data order.
- ``data/cached_fineweb10B.py N``: downloads the GPT-2 tokens of FineWeb10B (val shard + N train shards).
- ``data/prepare_text.py``: tokenizes local text into shards of the same format.
- ``data/hellaswag.py``: downloads, verifies and loads the HellaSwag validation set and renders its examples
  into GPT-2 tokens (train_gpt.py's ``--hellaswag``).
- ``data/smoke_corpus.py``: ``train_gpt.py --smoke``'s corpus when there are no shards: this repository's text
  as bytes.

See ``data/README.md`` for the byte layout and examples.
"""
