"""A corpus encoded and searched in shards, one per process of a torch.distributed group (torchrun), or
one shard in a single process: the same code path for both.

The corpus is cut into fixed blocks of ``block`` rows, and each process takes a contiguous run of blocks
(its shard). Blocks are encoded one at a time (``index.embeddings``), so a process holds at most one block
of passage texts as strings, and its shard's embeddings (in memory, or in a memory-mapped ``.npy`` that an
interrupted run resumes block by block). Because the blocks do not depend on the number of processes, every
passage is encoded in the same batch and every score computed by the same matrix product whatever that
number is: sharded results equal one process's, bit for bit (on one kind of device, with the same threads).

Search is exact: each process searches its shard by inner product (``index.exact``, in chunks aligned to
the blocks), the per-shard top-k are all-gathered and merged by (score, then passage row), the tie-break
``exact_search`` uses, so the merged list is the single-process one. Memory per process is bounded by its
shard plus ``world x k`` candidates per query chunk.

An encoding directory has a manifest (``shards.json``, written atomically by rank 0) recording the layout
(rows, dimension, block, processes), each shard's rows and file, and the fingerprints of the model (weights
and architecture) and of the corpus. A directory holding another model's or corpus's shards is refused with
a one-line error rather than silently re-encoded: those rows cost hours to compute and the caller may have
pointed at the wrong directory. Shards of the same content laid out for another number of processes are
encoded again (with a warning).

This is the ANN-free half of the neural-retrieval-lecture's "index the corpus once, search it by MIPS"
recipe, made to fit on several machines; negative-contrast and training-inference-gap mine hard negatives
with exactly this search.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from densepass import distributed
from densepass.data.dataset import Corpus, LazyTexts
from densepass.device import default_device, env_switch, resolve_precision
from densepass.errors import DataError, DataWarning, DensepassError
from densepass.fingerprints import fingerprint_corpus, fingerprint_json, fingerprint_tokenizer, fingerprint_weights
from densepass.index.embeddings import create_memmap, encode_in_blocks, encode_to_memmap
from densepass.index.exact import exact_search, score_block_queries, sort_by_score_then_row
from densepass.io import atomic_write_text, exclusive_lock
from densepass.models import cpu_kernels
from densepass.models.biencoder import BiEncoder

DEFAULT_BLOCK = 65_536  # rows encoded (and searched) together; a search chunk's scores are 4096 x block floats
SHARDS_FILE = "shards.json"
FORMAT = 1
CACHE_FOLDER = "passage-embeddings"  # under a run's cache_dir: a folder of shards per encoding (encode_cached)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """``rows`` passages in blocks of ``block`` rows, split into ``world`` contiguous runs of whole blocks."""

    rows: int
    world: int
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.rows < 0 or self.world < 1 or self.block < 1:
            raise DensepassError(f"bad shard plan: {self.rows} rows, {self.world} processes, blocks of {self.block}")

    def shard(self, rank: int) -> tuple[int, int]:
        """The rows ``[start, end)`` of process ``rank`` (empty when there are fewer blocks than processes)."""
        blocks = -(-self.rows // self.block)
        first, last = rank * blocks // self.world, (rank + 1) * blocks // self.world
        return min(first * self.block, self.rows), min(last * self.block, self.rows)


PROMPTED_ENCODING = 2
"""The version of a prompted model's encodings: before it, index builds and mining left the prompts out (unprompted
models' encodings did not change, and keep their fingerprint)."""


def encoder_fingerprint(model: BiEncoder, precision: str) -> str:
    """Fingerprint of what determines a passage's embedding: the model's weights and architecture, and the
    precision it runs in (``resolve_precision``'s answer)."""
    prompted = model.config.query_prompt or model.config.passage_prompt
    return fingerprint_json(
        {
            "weights": fingerprint_weights(model),
            "architecture": dataclasses.asdict(model.config),
            "precision": precision,
            **({"prompted_encoding": PROMPTED_ENCODING} if prompted else {}),
        }
    )


@dataclasses.dataclass
class ShardedEmbeddings:
    """This process's shard of a corpus's passage embeddings (rows ``plan.shard(rank)``)."""

    plan: ShardPlan
    rank: int
    local: np.ndarray  # [end - start, dim] float32, in memory or memory-mapped
    directory: Path | None = None  # where the shards are (None: in memory)
    content: dict[str, str] | None = None  # fingerprints of the encoder ("model") and "corpus", from the manifest

    @classmethod
    def whole(cls, embeddings: np.ndarray, block: int = DEFAULT_BLOCK) -> ShardedEmbeddings:
        """Embeddings one process already holds in full (searched without any collective)."""
        return cls(ShardPlan(len(embeddings), 1, block), 0, embeddings)

    @property
    def start(self) -> int:
        """The corpus row of this shard's first row."""
        return self.plan.shard(self.rank)[0]

    def search(
        self, queries: np.ndarray, k: int, device: torch.device | None = None, query_chunk: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, corpus rows) of every query over the whole corpus, best first, equal scores by row;
        the same on every process (each passes the same queries). Queries go in chunks (``query_chunk`` None:
        a block's scores within ``exact.SCORE_BLOCK_BYTES``), the same on every process."""
        k = min(k, self.plan.rows)
        query_chunk = query_chunk or score_block_queries(self.plan.block)
        scores_out = np.empty((len(queries), k), dtype=np.float32)
        rows_out = np.empty((len(queries), k), dtype=np.int64)
        for qs in range(0, len(queries), query_chunk):
            q = queries[qs : qs + query_chunk]
            scores = torch.full((len(q), k), -torch.inf)
            rows = torch.full((len(q), k), self.plan.rows, dtype=torch.int64)  # padding: after every real row
            if len(self.local):
                s, r = exact_search(q, self.local, k, device, query_chunk=query_chunk, passage_chunk=self.plan.block)
                scores[:, : s.shape[1]], rows[:, : r.shape[1]] = torch.from_numpy(s), torch.from_numpy(r + self.start)
            if self.plan.world > 1:
                scores, rows = sort_by_score_then_row(
                    torch.cat(distributed.all_gather(scores), 1), torch.cat(distributed.all_gather(rows), 1)
                )
            scores_out[qs : qs + len(q)], rows_out[qs : qs + len(q)] = scores[:, :k].numpy(), rows[:, :k].numpy()
        return scores_out, rows_out

    def every_shard(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first corpus row, rows) of every non-empty shard, in order, memory-mapped from their files (this
        process must see the other shards' files); this shard alone for one process."""
        if self.plan.world == 1:
            yield 0, self.local
            return
        if self.directory is None:
            raise DensepassError(
                "shards encoded in memory are not readable by another process: encode them into a directory"
            )
        for rank in range(self.plan.world):
            start, end = self.plan.shard(rank)
            if end > start:
                yield start, np.load(shard_path(self.directory, self.plan, rank), mmap_mode="r")

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """The embeddings of corpus ``rows`` (sorted, each once) read from every shard, as one array."""
        parts = []
        for start, shard in self.every_shard():
            mine = rows[(rows >= start) & (rows < start + len(shard))]
            parts.append(np.asarray(shard[mine - start], dtype=np.float32))
        return np.concatenate(parts)

    def assemble(self, path: str | Path) -> np.ndarray:
        """Every shard's rows as one array, on rank 0 (which must see the other shards' files): this shard
        itself for one process, else the shards copied block by block into a ``.npy`` memory map at ``path``."""
        if self.plan.world == 1:
            return self.local
        dim = self.local.shape[1]
        out = create_memmap(path, (self.plan.rows, dim))  # its blocks reserved: a full disk is one line, not SIGBUS
        for start, shard in self.every_shard():
            for s in range(0, len(shard), self.plan.block):
                out[start + s : start + min(s + self.plan.block, len(shard))] = shard[s : s + self.plan.block]
        out.flush()
        return out


def shard_path(directory: Path, plan: ShardPlan, rank: int) -> Path:
    """The file of process ``rank``'s shard (named by its rows)."""
    start, end = plan.shard(rank)
    return directory / f"rows-{start:012d}-{end:012d}.npy"


def encode_sharded(
    model: BiEncoder,
    texts: LazyTexts,
    directory: str | Path | None = None,
    corpus_fingerprint: str | None = None,
    block: int = DEFAULT_BLOCK,
    batch_size: int = 256,
    device: torch.device | None = None,
    show_progress: bool = True,
    precision: str = "auto",
    replace_other: bool = False,
    encoder: str | None = None,
) -> ShardedEmbeddings:
    """Encode this process's shard of the passage encoder inputs ``texts`` (every process passes a view of the
    same corpus), block by block: into ``directory`` (resumable, with a manifest; ``corpus_fingerprint``
    required) or in memory, in ``precision`` (``models.encode``; part of the manifest's model fingerprint).
    Shards in ``directory`` of another model or corpus are refused, or removed with ``replace_other`` (a
    directory private to one build); ``encoder``: the model's ``encoder_fingerprint`` where the caller has it.
    Collective: every process of the group must call it."""
    rank = distributed.rank()
    precision = resolve_precision(precision, device or default_device())
    plan = ShardPlan(len(texts), distributed.world_size(), block)
    start, end = plan.shard(rank)
    options = dict(batch_size=batch_size, device=device, show_progress=show_progress and rank == 0, precision=precision)
    if directory is None:
        local = encode_in_blocks(model, texts.window(start, end), "passage", block, **options) if end > start else None
        return ShardedEmbeddings(plan, rank, _or_empty(local, model.dim))
    if corpus_fingerprint is None:
        raise DensepassError("encoding shards into a directory needs the corpus fingerprint for its manifest")
    directory = Path(directory)
    content = {"model": encoder or encoder_fingerprint(model, precision), "corpus": corpus_fingerprint}
    _prepare_directory(directory, plan, content, model.dim, replace_other)
    local = None
    if end > start:
        path = shard_path(directory, plan, rank)
        local = encode_to_memmap(model, texts.window(start, end), "passage", path, shard_size=block, **options)
    distributed.barrier()  # every shard is complete before anyone reads another's
    return ShardedEmbeddings(plan, rank, _or_empty(local, model.dim), directory, content)


def cache_key(
    model: BiEncoder,
    corpus_fingerprint: str,
    precision: str,
    batch_size: int,
    block: int,
    device: torch.device,
    encoder: str | None = None,
) -> str:
    """The fingerprint of everything that determines a corpus's passage embeddings: the model's weights and
    architecture (pooling, prompts, lengths, the tower's own config), its tokenizer (with the separator that joins
    titles to texts and the side it truncates), the precision, batch and block it is encoded in, the kind of device
    and, on a CPU in bf16 or int8, which build of densepass's kernels runs (or none: another code path), torch's
    version, and the corpus (``encoder``: the model's ``encoder_fingerprint`` where the caller has it)."""
    tokenizer = model.tokenizer
    kernels = None
    if device.type == "cpu" and precision != "fp32" and env_switch(cpu_kernels.ENV) is not False:
        kernels = cpu_kernels.layer_kind()
    return fingerprint_json(
        {
            "encoder": encoder or encoder_fingerprint(model, precision),
            "tower": tower_config(model),
            "tokenizer": fingerprint_tokenizer(tokenizer),
            "separator": tokenizer.sep_token,
            "truncation_side": getattr(tokenizer, "truncation_side", "right"),
            "corpus": corpus_fingerprint,
            "batch_size": batch_size,
            "block": block,
            "device": device.type,
            "kernels": kernels,
            "torch": torch.__version__,
            "format": FORMAT,
        }
    )[:32]


def tower_config(model: BiEncoder) -> dict:
    """The passage tower's ``transformers`` config, without where it was loaded from and the version that saved it
    (a model saved and loaded again is the same model)."""
    config = model.passage_encoder.config.to_dict()
    return {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}


def encode_cached(
    model: BiEncoder,
    corpus: Corpus,
    cache_dir: str | Path,
    block: int = DEFAULT_BLOCK,
    batch_size: int = 256,
    device: torch.device | None = None,
    show_progress: bool = True,
    precision: str = "auto",
) -> ShardedEmbeddings:
    """The passage embeddings of ``corpus`` from the content-keyed cache ``cache_dir`` (one process): encoded into
    ``<cache_dir>/passage-embeddings/<cache_key>`` the first time (resumably, block by block), read from there by
    every later call with the same model, tokenizer, settings and corpus, in this run or another. Any change to
    any of them is another key, so a stale encoding is never read; no entry is ever removed (one holds 4 x passages x
    dim bytes), only an entry's own damaged or unfinished files are encoded again. Runs that ask for the same entry
    at once take turns (``io.exclusive_lock`` on it): the first encodes, the others then read what it wrote."""
    if distributed.world_size() > 1:
        raise DensepassError("encode_cached encodes in one process: under torchrun, use encode_sharded")
    device = device or default_device()
    precision = resolve_precision(precision, device)
    fingerprint = fingerprint_corpus(corpus)
    encoder = encoder_fingerprint(model, precision)  # once: every weight is hashed (seconds for a large model)
    key = cache_key(model, fingerprint, precision, batch_size, block, device, encoder)
    directory = Path(cache_dir) / CACHE_FOLDER / key
    texts = corpus.lazy_inputs(model.tokenizer.sep_token or " ")
    options = dict(block=block, batch_size=batch_size, device=device, show_progress=show_progress, precision=precision)
    with exclusive_lock(directory, "encoding", wait=True):
        return encode_sharded(model, texts, directory, fingerprint, encoder=encoder, **options)


def _or_empty(local: np.ndarray | None, dim: int) -> np.ndarray:
    return local if local is not None else np.zeros((0, dim), dtype=np.float32)


def _prepare_directory(
    directory: Path, plan: ShardPlan, content: dict[str, str], dim: int, replace_other: bool
) -> None:
    """Check the directory's manifest against this encoding (every process reads it, so every process takes
    the same decision): refuse shards of another model or corpus (``content``: their fingerprints), or with
    ``replace_other`` clear them; clear shards of another layout; have rank 0 write the manifest."""
    manifest = directory / SHARDS_FILE
    layout = {"format": FORMAT, "rows": plan.rows, "dim": dim, "block": plan.block, "world": plan.world}
    recorded = _read_manifest(manifest)
    other = recorded is not None and any(recorded.get(what) != mine for what, mine in content.items())
    if other and not replace_other:
        what, mine = next((what, mine) for what, mine in content.items() if recorded.get(what) != mine)
        raise DataError(
            f"{directory} holds passages encoded with another {what} (fingerprint "
            f"{str(recorded.get(what))[:12]}, this one {mine[:12]}): delete it or encode into another directory"
        )
    fresh = recorded is None or other or any(recorded.get(key) != value for key, value in layout.items())
    distributed.barrier()  # everyone has read the old manifest before rank 0 replaces it
    if distributed.rank() == 0 and fresh:
        if recorded is not None and not other:
            warnings.warn(
                f"{directory} holds shards for {recorded.get('world')} processes; encoding again for {plan.world}",
                DataWarning,
                stacklevel=3,
            )
        for stale in directory.glob("rows-*"):
            stale.unlink()
        shards = [
            {"rank": r, "start": plan.shard(r)[0], "end": plan.shard(r)[1], "file": shard_path(directory, plan, r).name}
            for r in range(plan.world)
        ]
        record = {**layout, **content, "shards": shards}
        atomic_write_text(manifest, json.dumps(record, indent=2))
    distributed.barrier()  # the directory is ready for every process


def _read_manifest(path: Path) -> dict | None:
    """The shards manifest, or None when there is none (an unreadable one is reported and treated as none)."""
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text())
        if isinstance(recorded, dict):
            return recorded
    except (OSError, ValueError):
        pass
    warnings.warn(f"{path} is unreadable; encoding the shards again", DataWarning, stacklevel=4)
    return None
