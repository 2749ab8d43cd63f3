"""Tier 3: cached KV blocks as files on local disk, under a size cap, least recently used out.

One file per block, named by its hash (`<hex>.kv`, the block's raw bytes), written by a
background thread from a bounded queue: the engine never waits on the disk, and when the disk
cannot keep up, blocks are dropped rather than queued without bound. Files appear by rename, so
a crash leaves whole blocks or none. `layout.json` records the layout and hash namespace the
blocks were written with; a directory written with another one is emptied at start-up.

Warm restart: a pod that starts on a directory from an earlier run indexes the files it finds
(oldest first by modification time) and serves them; `take_events` reports them as stored.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.offload.layout import BlockLayout

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_MANIFEST = "layout.json"
_STOP = None  # queue sentinel


class DiskBlockStore:
    def __init__(
        self, directory: str | Path, capacity_bytes: int, layout: BlockLayout, max_pending: int = 64
    ) -> None:
        if capacity_bytes < layout.block_bytes:
            raise ValueError(
                f"disk tier capacity {capacity_bytes} bytes holds no block of {layout.block_bytes}"
            )
        self.directory = Path(directory)
        self.layout = layout
        self.capacity_blocks = capacity_bytes // layout.block_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, None] = OrderedDict()
        self._stored: list[BlockHash] = []  # events not yet taken
        self._removed: list[BlockHash] = []
        self.num_writes = 0
        self.num_dropped_writes = 0
        self._queue: queue.Queue[tuple[BlockHash, torch.Tensor] | None] = queue.Queue(max_pending)
        self._open_directory()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index)

    def write_async(self, block_hash: BlockHash, data: torch.Tensor) -> bool:
        """Queues one block (a tensor the caller no longer writes) for the writer; False when
        the queue is full and the block was dropped, or the block is already on disk."""
        if block_hash in self._index:
            return False
        try:
            self._queue.put_nowait((block_hash, data))
        except queue.Full:
            self.num_dropped_writes += 1
            return False
        return True

    def read(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block's KV, or None when it is not (or no longer) on disk or the file is bad."""
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        try:
            array = np.fromfile(self._path(block_hash), dtype=np.uint8)
        except OSError:
            return None
        if array.size != self.layout.block_bytes:
            return None
        flat = torch.from_numpy(array).view(self.layout.torch_dtype)
        return flat.view(self.layout.block_shape)

    def flush(self) -> None:
        """Waits until every queued block is on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._writer.join(timeout=10)

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(hashes stored, hashes removed) since the last call."""
        with self._lock:
            stored, self._stored = self._stored, []
            removed, self._removed = self._removed, []
        return stored, removed

    # ---- the writer thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write(*item)
            except OSError as error:
                logger.warning("KV disk tier: writing a block failed: %s", error)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        path = self._path(block_hash)
        temporary = path.with_suffix(".tmp")
        data.contiguous().view(torch.uint8).numpy().tofile(temporary)
        os.replace(temporary, path)
        with self._lock:
            self._index[block_hash] = None
            self._stored.append(block_hash)
            self.num_writes += 1
            while len(self._index) > self.capacity_blocks:
                self._remove_oldest()

    def _remove_oldest(self) -> None:
        block_hash, _ = self._index.popitem(last=False)
        self._removed.append(block_hash)
        self._path(block_hash).unlink(missing_ok=True)

    # ---- start-up ---------------------------------------------------------------------------

    def _open_directory(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        manifest = self.directory / _MANIFEST
        expected = self.layout.to_dict()
        if manifest.exists() and _read_json(manifest) != expected:
            logger.warning("KV disk tier: %s holds another layout; emptying it", self.directory)
            for path in self.directory.glob(f"*{_SUFFIX}"):
                path.unlink()
        manifest.write_text(json.dumps(expected))
        for path in self.directory.glob("*.tmp"):
            path.unlink()  # a write cut short by a crash
        self._index_existing_files()

    def _index_existing_files(self) -> None:
        files = sorted(self.directory.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            if path.stat().st_size != self.layout.block_bytes:
                path.unlink()
                continue
            block_hash = BlockHash(bytes.fromhex(path.stem))
            self._index[block_hash] = None
            self._stored.append(block_hash)
        while len(self._index) > self.capacity_blocks:
            self._remove_oldest()
        self._removed.clear()  # never announced: nobody knew of them
        if self._index:
            logger.info(
                "KV disk tier: %d blocks from an earlier run in %s", len(self), self.directory
            )

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}{_SUFFIX}"


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
