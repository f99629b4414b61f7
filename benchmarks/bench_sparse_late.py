r"""SPLADE and ColBERT speed, in one run: densepass against sentence-transformers' SparseEncoder and PyLate.

    python benchmarks/bench_sparse_late.py --out outputs/bench/sparse-late.json \
        --pylate-python /path/to/venv-pylate/bin/python                       # a quiet machine or a GPU
    python benchmarks/bench_sparse_late.py --steps 1 --warmup 1 --batch-size 4 --passages 16 --tiny   # smoke

1. **SPLADE training**: ``densepass`` (SpladeEncoder, contrastive + FLOPS via ``train``) against
   ``SparseEncoderTrainer`` with ``SpladeLoss(SparseMultipleNegativesRankingLoss)`` and its FlopsLoss
   regularisers, from the *same* checkpoint (a densepass SPLADE model saved once; it loads in both), the same
   (query, positive, BM25 negative) triplets, batch size, lengths, lambdas and learning rate. Timed as in
   bench_train.py: optimisation steps only, after ``--warmup`` untimed ones.
2. **SPLADE encoding**: ``SpladeEncoder.encode_passages`` (sparse CSR out) against
   ``SparseEncoder.encode_document`` (sparse tensors out) over ``--passages`` corpus passages.
3. **ColBERT training and encoding** against PyLate (``pylate.models.ColBERT`` + ``losses.Contrastive`` on the
   sentence-transformers trainer; ``model.encode(is_query=False)``), same base model, 128 dimensions, query /
   passage lengths, batch and triplets. PyLate pins other sentence-transformers / transformers versions than
   densepass, so it runs in its own environment: ``--pylate-python`` is that environment's interpreter, which
   runs this script's ``--pylate-part`` in a subprocess. Without it (or if PyLate does not import there), the
   rows say so.
4. **ColBERT search**: the centroid-pruned ``ColbertIndex`` against a straightforward exact MaxSim over all
   token vectors (``exhaustive=True``) on the same index, queries per second and recall of the exact top 10.

Training runs in float32 on CPU (under bf16 autocast with ``--cpu-bf16``, on both sides) and under bf16 autocast
on GPU. densepass encodes in ``--encode-precisions`` (default ``auto``: bf16 on a GPU and on a CPU with fast bf16,
where its copy of the encoder runs fused layers; else fp32); SparseEncoder and PyLate encode their float32 model,
and with ``--other-bf16`` also the model cast to bfloat16 (``model.to(torch.bfloat16)``, their fastest CPU setting
where bf16 is fast). Encodings are timed ``--repeats`` rounds, the systems in turn, the fastest reported (PyLate's
rounds run in its own process, after densepass's). ``--no-train`` times encoding and search only:

    PYTHONPATH=src venv-bench/bin/python benchmarks/bench_sparse_late.py --no-train --encode-precisions fp32 bf16 \
        --other-bf16 --repeats 3 --pylate-python venv-pylate/bin/python --out outputs/bench/sparse-late-encode.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import StepClock, environment, markdown_table, output_file, pick_device, rate, sync, write_json

FIELDS = ("anchor", "positive", "negative")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def st_trainer_seconds(model, loss, triplets: dict, args, device, bf16: bool) -> float:
    """Timed steps of a sentence-transformers-style trainer (SparseEncoderTrainer or PyLate's)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    clock = StepClock(device, args.warmup, args.warmup + args.steps)

    class Timing(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            clock(state.global_step)

    total = args.warmup + args.steps + 1
    with tempfile.TemporaryDirectory() as tmp:
        training_args = dict(
            output_dir=tmp,
            per_device_train_batch_size=args.batch_size,
            max_steps=total,
            learning_rate=args.learning_rate,
            warmup_steps=int(0.1 * total),
            bf16=bf16,
            use_cpu=device.type == "cpu",
            save_strategy="no",
            report_to="none",
            logging_steps=10**9,
            dataloader_drop_last=True,
            seed=13,
            disable_tqdm=True,
        )
        trainer = build_trainer(model, loss, Dataset.from_dict(triplets), training_args)
        trainer.add_callback(Timing())
        trainer.train()
    return clock.seconds


def build_trainer(model, loss, dataset, training_args: dict):
    """SparseEncoderTrainer for a SparseEncoder, SentenceTransformerTrainer with PyLate's collator otherwise."""
    if type(model).__name__ == "SparseEncoder":
        from sentence_transformers.sparse_encoder import SparseEncoderTrainer, SparseEncoderTrainingArguments

        return SparseEncoderTrainer(
            model=model, args=SparseEncoderTrainingArguments(**training_args), train_dataset=dataset, loss=loss
        )
    from pylate.utils import ColBERTCollator
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    # PyLate's collator tokenises the anchor as a query and the other columns as documents; the default one
    # would tokenise every column as a query (32 tokens, [MASK]-expanded), a third of the passage work
    return SentenceTransformerTrainer(
        model=model,
        args=SentenceTransformerTrainingArguments(**training_args),
        train_dataset=dataset,
        loss=loss,
        data_collator=ColBERTCollator(model.tokenize),
    )


# ---- the PyLate side (run by --pylate-python in its own environment) ----------------------------------------


def pylate_part(args) -> None:
    """Train and encode with PyLate; print one JSON line of results."""
    try:
        from pylate import losses, models
    except Exception as err:  # noqa: BLE001 - any import failure means "not available here"
        print(json.dumps({"error": f"PyLate does not import: {type(err).__name__}: {err}"}))
        return
    payload = json.loads(Path(args.pylate_part).read_text())
    device = pick_device(args.device)
    bf16 = device.type == "cuda" or args.cpu_bf16

    def load() -> models.ColBERT:
        return models.ColBERT(
            payload["model"],
            device=str(device),
            embedding_size=128,
            query_length=args.query_max_length,
            document_length=args.passage_max_length,
        )

    train_s = None
    if not args.no_train:
        model = load()
        loss = losses.Contrastive(model=model, temperature=1.0)
        train_s = st_trainer_seconds(model, loss, payload["triplets"], args, device, bf16)
    # fresh models encode: after a bf16 run, accelerate leaves the trained model's forward wrapped in bf16
    # autocast, so it would encode in bf16 while densepass encodes in float32 on the CPU
    passages = payload["passages"]
    models_by_dtype = {"fp32": load().eval()}
    if args.other_bf16:
        models_by_dtype["bf16"] = load().to(torch.bfloat16).eval()
    encoders = {
        dtype: lambda m=model: m.encode(
            passages, is_query=False, batch_size=args.encode_batch_size, show_progress_bar=False
        )
        for dtype, model in models_by_dtype.items()
    }
    encode_s = fastest_in_turn(encoders, args.repeats, device)
    import pylate

    print(json.dumps({"train_s": train_s, "encode_s": encode_s, "pylate": pylate.__version__}))


# ---- the densepass side ------------------------------------------------------------------------------------


def densepass_train_seconds(model, data, args, device, objective) -> float:
    from densepass.config import TrainConfig
    from densepass.training.trainer import train

    total = args.warmup + args.steps + 1
    config = TrainConfig(
        max_steps=total,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_ratio=0.1,
        bf16=True,
        cpu_bf16=args.cpu_bf16,
        checkpoint_every=10**9,
        log_every=10**9,
        seed=13,
    )
    clock = StepClock(device, args.warmup, args.warmup + args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        train(model, data, config, Path(tmp), device, on_step_end=clock, objective=objective)
    return clock.seconds


def fastest_in_turn(encoders: dict, repeats: int, device) -> dict[str, float]:
    """Each encoder's fastest time over ``repeats`` rounds, the encoders in turn within a round (a drift in the
    machine's speed reaches each alike), after one untimed call each."""
    for encode in encoders.values():
        encode()
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, encode in encoders.items():
            seconds = timed(device, encode)
            best[name] = min(best.get(name, seconds), seconds)
    return best


def timed(device, fn) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def training_data(args, path: str):
    """Train queries with one BM25 negative each: densepass TrainingData and the same triplets as columns."""
    from densepass.data import load_dataset
    from densepass.index.bm25 import BM25Index
    from densepass.negatives.bm25 import mine_bm25_negatives
    from densepass.negatives.pool import passage_ids
    from densepass.training.batches import TrainingData

    dataset = load_dataset(args.dataset, args.data_dir)
    n = (args.warmup + args.steps + 1) * args.batch_size
    positives = dataset.positives("train")
    qids = sorted(np.random.default_rng(13).choice(sorted(positives), size=n, replace=False).tolist())
    negatives = passage_ids(
        mine_bm25_negatives(dataset, BM25Index.build(dataset.corpus.passage_inputs(" ")), qids, depth=20)
    )
    data = TrainingData(dataset, "train", "[SEP]", negatives, 1, query_ids=qids)
    rng = np.random.default_rng(13)
    triplets = {
        "anchor": data.query_texts,
        "positive": [data.passage_inputs[rows[0]] for rows in data.positive_rows],
        "negative": [
            data.passage_inputs[int(rng.choice(pool))] if len(pool) else data.passage_inputs[0]
            for pool in data.negative_rows
        ],
    }
    passages = dataset.corpus.passage_inputs("[SEP]")
    sample = np.random.default_rng(7).choice(len(passages), size=min(args.passages, len(passages)), replace=False)
    return data, triplets, [passages[i] for i in sample]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed optimisation steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--query-max-length", type=int, default=32)
    parser.add_argument("--passage-max-length", type=int, default=128)
    parser.add_argument("--passages", type=int, default=2000, help="passages encoded (and searched for ColBERT)")
    parser.add_argument("--encode-batch-size", type=int, default=64)
    parser.add_argument("--queries", type=int, default=100, help="ColBERT search: queries")
    parser.add_argument("--lambda-q", type=float, default=5e-4)
    parser.add_argument("--lambda-d", type=float, default=3e-4)
    parser.add_argument("--pylate-python", default=None, help="interpreter of an environment with PyLate")
    parser.add_argument("--pylate-part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="smoke test: a tiny random BERT instead of the model")
    parser.add_argument("--device", default=None)
    parser.add_argument("--cpu-bf16", action="store_true", help="train under bf16 autocast on the CPU (both sides)")
    parser.add_argument("--no-train", action="store_true", help="encoding and search only (both sides)")
    parser.add_argument(
        "--encode-precisions", nargs="+", default=["auto"], help="densepass encoding precisions (fp32, bf16, auto)"
    )
    parser.add_argument(
        "--other-bf16", action="store_true", help="SparseEncoder and PyLate also encode with their model in bf16"
    )
    parser.add_argument("--repeats", type=int, default=1, help="encoding rounds (systems in turn); the fastest")
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.pylate_part:
        pylate_part(args)
        return

    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    from densepass.device import resolve_precision
    from densepass.index.colbert import ColbertIndex
    from densepass.losses.objectives import FLOPS, InfoNCE
    from densepass.models.biencoder import resolve_model_path
    from densepass.models.colbert import ColBERT, ColbertArchitecture
    from densepass.models.copies import float_precision
    from densepass.models.splade import SpladeArchitecture, SpladeEncoder

    device = pick_device(args.device)
    bf16 = device.type == "cuda" or args.cpu_bf16
    precisions = list(dict.fromkeys(resolve_precision(p, device) for p in args.encode_precisions))
    for precision in precisions:
        float_precision(precision, device, "SPLADE / ColBERT")  # int8 fails before any work
    other_dtypes = [torch.float32, *([torch.bfloat16] if args.other_bf16 else [])]
    env = environment(device)
    print(f"device: {env['device']}; torch {env['torch']}, sentence-transformers {env['sentence_transformers']}")
    work = Path(tempfile.mkdtemp(prefix="bench-sparse-late-"))
    path = tiny_model(work) if args.tiny else resolve_model_path(args.model)
    data, triplets, passages = training_data(args, path)
    lengths = {"query_max_length": args.query_max_length, "passage_max_length": args.passage_max_length}
    results: list[dict] = []

    def record(part: str, system: str, seconds: float | None, count: int, unit: str, note: str = "") -> None:
        results.append({"part": part, "system": system, "seconds": seconds, "count": count, "unit": unit, "note": note})
        shown = f"{seconds:.2f}s, {rate(count / seconds)} {unit}/s" if seconds else note
        print(f"  {part} / {system}: {shown}", flush=True)

    # 1-2. SPLADE: one starting checkpoint for both libraries
    start = work / "splade-start"
    SpladeEncoder.from_pretrained(path, config=SpladeArchitecture(temperature=1.0, **lengths)).save(start)
    objective = InfoNCE() + FLOPS(lambda_q=args.lambda_q, lambda_d=args.lambda_d, warmup_steps=0)
    examples = args.steps * args.batch_size
    if not args.no_train:
        splade = SpladeEncoder.from_pretrained(str(start))
        seconds = densepass_train_seconds(splade, data, args, device, objective)
        record("SPLADE train", "densepass", seconds, examples, "ex")
        st = SparseEncoder(str(start), device=str(device))
        st.max_seq_length = args.passage_max_length
        loss = SpladeLoss(
            st,
            loss=SparseMultipleNegativesRankingLoss(st, scale=1.0),
            query_regularizer_weight=args.lambda_q,
            document_regularizer_weight=args.lambda_d,
        )
        seconds = st_trainer_seconds(st, loss, triplets, args, device, bf16)
        record("SPLADE train", "SparseEncoderTrainer + SpladeLoss", seconds, examples, "ex")
    splade = SpladeEncoder.from_pretrained(str(start))  # the starting weights, on both sides
    encoders = {}
    for precision in precisions:
        encoders[f"densepass {precision}"] = lambda p=precision: splade.encode_passages(
            passages, args.encode_batch_size, device=device, precision=p
        )
    for dtype in other_dtypes:
        st = SparseEncoder(str(start), device=str(device)).to(dtype).eval()
        st.max_seq_length = args.passage_max_length
        name = f"SparseEncoder.encode_document {DTYPE_NAMES[dtype]}"
        encoders[name] = lambda m=st: m.encode_document(passages, batch_size=args.encode_batch_size)
    for system, seconds in fastest_in_turn(encoders, args.repeats, device).items():
        record("SPLADE encode", system, seconds, len(passages), "passages")

    # 3. ColBERT training and encoding
    torch.manual_seed(13)
    colbert = ColBERT.from_pretrained(path, config=ColbertArchitecture(temperature=1.0, **lengths))
    if not args.no_train:
        seconds = densepass_train_seconds(colbert, data, args, device, None)
        record("ColBERT train", "densepass", seconds, examples, "ex")
        torch.manual_seed(13)
        colbert = ColBERT.from_pretrained(path, config=ColbertArchitecture(temperature=1.0, **lengths))
    encoders = {
        f"densepass {precision}": lambda p=precision: colbert.encode_passages(
            passages, args.encode_batch_size, device=device, precision=p
        )
        for precision in precisions
    }
    for system, seconds in fastest_in_turn(encoders, args.repeats, device).items():
        record("ColBERT encode", system, seconds, len(passages), "passages")
    pylate = run_pylate(args, path, triplets, passages, work)
    if "error" in pylate:
        if not args.no_train:
            record("ColBERT train", "PyLate", None, examples, "ex", pylate["error"])
        record("ColBERT encode", "PyLate", None, len(passages), "passages", pylate["error"])
    else:
        if not args.no_train:
            record("ColBERT train", f"PyLate {pylate['pylate']}", pylate["train_s"], examples, "ex")
        for dtype, seconds in pylate["encode_s"].items():
            record("ColBERT encode", f"PyLate {pylate['pylate']} {dtype}", seconds, len(passages), "passages")

    # 4. ColBERT search: centroid pruning + exact MaxSim against exact MaxSim over every token vector
    index = ColbertIndex.build(colbert, passages, device=device)
    queries = data.query_texts[: args.queries]
    encoded = index.encode_queries(queries)
    pruned = index.search(encoded, 10)
    exact = index.search(encoded, 10, exhaustive=True)
    recall = np.mean([len(set(a) & set(b)) / max(len(b), 1) for a, b in zip(pruned.rows.tolist(), exact.rows.tolist())])
    record(
        "ColBERT search",
        "densepass centroid pruning",
        timed(device, lambda: index.search(encoded, 10)),
        len(queries),
        "queries",
        f"recall of the exact top 10: {recall:.3f}",
    )
    record(
        "ColBERT search",
        "exact MaxSim, all token vectors",
        timed(device, lambda: index.search(encoded, 10, exhaustive=True)),
        len(queries),
        "queries",
    )

    rows = [
        [
            r["part"],
            r["system"],
            f"{r['seconds']:.2f}" if r["seconds"] else "-",
            rate(r["count"] / r["seconds"]) if r["seconds"] else "-",
            r["unit"] + "/s",
            r["note"],
        ]
        for r in results
    ]
    print(
        "\n"
        + (
            "no training, "
            if args.no_train
            else f"batch {args.batch_size} + 1 BM25 negative each, {args.steps} timed steps after {args.warmup}, "
            f"training in {'bf16 autocast' if bf16 else 'fp32'}, "
        )
        + f"query {args.query_max_length} / passage {args.passage_max_length} tokens, {len(passages)} passages, "
        f"densepass encoding in {', '.join(precisions)}, best of {args.repeats}"
    )
    print(markdown_table(["part", "system", "seconds", "rate", "unit", "note"], rows))
    write_json(
        args.out,
        {
            "benchmark": "sparse-late",
            **env,
            "model": "tiny" if args.tiny else args.model,
            "args": vars(args),
            "results": results,
        },
    )


def run_pylate(args, path: str, triplets: dict, passages: list[str], work: Path) -> dict:
    """PyLate's timings from its own environment (a subprocess), or {"error": why not}."""
    if not args.pylate_python:
        return {"error": "not run: no --pylate-python (PyLate needs its own environment)"}
    payload = work / "pylate-input.json"
    payload.write_text(json.dumps({"model": path, "triplets": triplets, "passages": passages}))
    # absolute, not resolved: the subprocess runs elsewhere, and a venv's python is a symlink to keep as it is
    command = [os.path.abspath(args.pylate_python), __file__, "--pylate-part", str(payload)]
    for flag in (
        "batch_size",
        "steps",
        "warmup",
        "learning_rate",
        "query_max_length",
        "passage_max_length",
        "encode_batch_size",
    ):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.device:
        command += ["--device", args.device]
    command += ["--repeats", str(args.repeats)]
    for flag in ("cpu_bf16", "no_train", "other_bf16"):
        if getattr(args, flag):
            command += [f"--{flag.replace('_', '-')}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"PyLate run failed: {tail}"}
    return json.loads(lines[-1])


def tiny_model(work: Path) -> str:
    """A 2-layer, 32-dim random BERT with MiniLM's tokenizer (--tiny smoke runs)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from densepass.models.biencoder import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    BertModel(config).save_pretrained(work / "tiny")
    tokenizer.save_pretrained(work / "tiny")
    return str(work / "tiny")


if __name__ == "__main__":
    main()
