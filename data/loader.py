"""Training batches on their way to the device: ``MicroBatch`` (one sequence of documents and what the model needs
of it, packed for one copy to the device) and ``BackgroundLoader`` (the next step's batch built on a thread while
the current step trains).

train_gpt.py's TrainLoader is a BackgroundLoader: it says which documents fill which micro-batch (the data order)
in its ``_build``; this module moves them. Validation and evaluation make their MicroBatch in the main thread.
"""
import dataclasses
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from data.shards import load_shard


@dataclass
class MicroBatch:
    """One sequence of documents and what the model needs of it (train_gpt.model_inputs makes what is None from
    ids)."""
    ids: torch.Tensor  # (T,) int32 inputs
    targets: torch.Tensor = None  # (T,) int64 (None: evaluation, no loss)
    prep: object = None  # kernels.embedding.EmbeddingPrep for ids (None: prepared in the backward)
    cu_seqlens: torch.Tensor = None  # (n_docs + 1,) int32 doc_cu_seqlens(ids) from the host (None: made here)
    bigram: torch.Tensor = None  # (T,) int32 bigram_hash(ids) from the loader thread (None: hashed on the device)
    bigram_prep: object = None  # EmbeddingPrep of bigram for the bigram table (None: prepared in the backward)
    max_len: int = None  # no document is longer (FlashAttention's grid): the stage's max_doc_len; None: T
    eager: torch.Tensor = None  # int32 buffer whose views are prep, bigram and bigram_prep (pack), or None

    OWN = ("ids", "targets", "cu_seqlens")  # tensors with storages of their own (the compiled region's inputs)
    ALIGN = 32  # int32 elements: each view of the packed buffer starts at a multiple of 128 bytes

    def _parts(self):
        """prep's three tensors, bigram and bigram_prep's three, those not None, in the order pack() writes them."""
        return [*(self.prep[:3] if self.prep is not None else ()), *(() if self.bigram is None else (self.bigram,)),
                *(self.bigram_prep[:3] if self.bigram_prep is not None else ())]

    def _layout(self):
        """The sizes that split a packed buffer into the parts (even entries) and the padding after each (odd
        entries), so that every part starts at a multiple of ALIGN elements; and the buffer's length."""
        sizes = []
        for t in self._parts():
            sizes += [t.numel(), -t.numel() % self.ALIGN]
        return sizes, sum(sizes)

    def _views(self, buf):
        """prep, bigram and bigram_prep (those not None) as views of ``buf`` (one split: the host cost of to())."""
        views = iter(buf.split_with_sizes(self._layout()[0])[::2])
        out = {}
        if self.prep is not None:
            out["prep"] = self.prep._replace(order=next(views), sorted_ids=next(views), row_ptr=next(views))
        if self.bigram is not None:
            out["bigram"] = next(views)
        if self.bigram_prep is not None:
            out["bigram_prep"] = self.bigram_prep._replace(order=next(views), sorted_ids=next(views),
                                                           row_ptr=next(views))
        return out

    def pack(self, pin=False):
        """This micro-batch with prep, bigram and bigram_prep (int32 tensors only the eager lookups read) copied into
        one buffer, whose views they become: to() moves it to the device with one copy instead of one per tensor.
        ids, targets and cu_seqlens stay tensors of their own: they are the compiled region's inputs, whose guards
        a view of a shared storage would change. pin: every tensor in pinned memory (for a non-blocking copy)."""
        own = {k: getattr(self, k) for k in self.OWN if getattr(self, k) is not None}
        own = {k: t.pin_memory() for k, t in own.items()} if pin else own
        parts = self._parts()
        if not parts:
            return dataclasses.replace(self, **own)
        buf = torch.empty(self._layout()[1], dtype=torch.int32, pin_memory=pin)
        packed = dataclasses.replace(self, **own, **self._views(buf), eager=buf)
        for dst, src in zip(packed._parts(), parts, strict=True):
            dst.copy_(src)
        return packed

    def to(self, device):
        """On ``device``, copied without blocking (from pinned memory: the copy overlaps the previous step)."""
        if self.eager is None:
            tensors = ("ids", "targets", "prep", "cu_seqlens", "bigram", "bigram_prep")
            return dataclasses.replace(self, **{k: getattr(self, k).to(device, non_blocking=True) for k in tensors
                                                if getattr(self, k) is not None})
        own = {k: getattr(self, k).to(device, non_blocking=True) for k in self.OWN if getattr(self, k) is not None}
        buf = self.eager.to(device, non_blocking=True)
        return dataclasses.replace(self, **own, **self._views(buf), eager=buf)


class BackgroundLoader:
    """A stream of training batches, each built by the subclass's ``_build(state)`` -> (this rank's micro-batches,
    the next state) on a background thread while the previous one trains. ``state`` (a dict, the checkpoint's
    "loader") says where the next batch starts; ``next()`` returns its micro-batches moved to ``device``."""

    def __init__(self, files, bos_id, device):
        self.files, self.bos_id, self.device = files, bos_id, device
        self._cache = {}
        self._q = queue.Queue(maxsize=1)
        self._thread = None

    def _shard(self, i):
        """(tokens memmap, BOS positions) of shard i; keeps only the shard in use (called by the worker only)."""
        if i not in self._cache:
            tokens = load_shard(self.files[i], mmap=True)
            self._cache = {i: (tokens, np.flatnonzero(np.asarray(tokens) == self.bos_id))}
        return self._cache[i]

    def _worker(self, state):
        try:
            self._q.put(self._build(state))
        except BaseException as e:  # surfaced in the main thread by next()
            self._q.put(e)

    def _start(self, state):
        self._thread = threading.Thread(target=self._worker, args=(state,), daemon=True)
        self._thread.start()

    def next(self):
        """This rank's micro-batches for the next step, moved to the device (non-blocking)."""
        if self._thread is None:
            self._start(self.state)
        item = self._q.get()
        self._thread.join()
        if isinstance(item, BaseException):
            raise item
        micro, self.state = item
        self._start(self.state)  # prepare the following step while this one trains
        return [mb.to(self.device) for mb in micro]

    def close(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            while not self._q.empty():
                self._q.get()

    def load_state(self, state):
        self.close()
        self.state = dict(state)
