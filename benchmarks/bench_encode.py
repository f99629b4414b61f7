r"""Encoding throughput: densepass ``encode_texts`` in each precision against ``SentenceTransformer.encode`` and its
ONNX / OpenVINO backends, same model, same ``title [SEP] text`` passages of debian-packages (or, ``--side query``,
its dev queries), same maximum length, in one run.

    python benchmarks/bench_encode.py --n 2000 --out outputs/bench/encode-cpu.json             # CPU
    python benchmarks/bench_encode.py --model .carry/minilm-l6-fp16 --data-dir .carry/data \
        --save-embeddings outputs/bench/emb --out outputs/bench/encode-h100.json                   # H100

densepass runs in fp32, bf16 (a bfloat16 copy; on CPU only where bf16 is fast, or with
``--densepass-precisions``; on CPU with fused BERT layers, ``models.fused``) and, on CPU, int8
(``models.encode``: with densepass's CPU kernels, the fused layers on int8 products; elsewhere dynamic
quantisation). ``--unfused`` adds densepass bf16 as it ran before the fused layers (transformers' layers, pieces of
2,048 tokens), ``--bf16-piece-tokens`` other piece sizes, ``--length-multiples`` other paddings of the fused
layers' inputs (1: none), ``--sdpa`` SDPA in the fused layers instead of the AMX attention kernel
(``models.cpu_kernels``); ``--profile`` prints, instead of timings, where each densepass setting's time goes
(``torch.profiler``). sentence-transformers runs as a user would run it: its default
batch size (32) and densepass's, in float32, and on a GPU or a CPU with fast bfloat16 (AMX, or AVX512-BF16 on AMD:
``device.cpu_has_fast_bf16``) in bfloat16 too (``model.to(torch.bfloat16)``). On CPU it also runs, where they
install (``--st-backends``), with ``backend="onnx"`` (fp32, and int8 from ``export_dynamic_quantized_onnx_model``)
and ``backend="openvino"``; those are exported offline from the model's files into a temporary copy. Where
sentence-transformers' ONNX backend does not install (its optimum-onnx needs transformers < 4.58), ``--ort`` runs
the same graph in ONNX Runtime directly: the transformer exported with ``torch.onnx``, fp32 and ORT's dynamic int8,
with the same tokenisation and mean pooling; ``--openvino`` likewise runs it converted by ``openvino.convert_model``
in OpenVINO's CPU plugin (f32, and bf16 where the CPU has fast bf16), for the OpenVINO backend (both sort and
batch the texts as sentence-transformers does). Each system first encodes a small warm-up set (not timed); then
the systems encode the texts in turn, ``--repeats`` rounds (a drift in the machine's speed reaches each alike),
and each one's fastest time is reported, with the ratio of densepass's fastest setting to the fastest other system
round by round (the two times of one round are closest in time). Agreement = mean cosine to sentence-transformers'
float32 embeddings. ``--cpu-time`` times each system by the process's CPU seconds instead (run it with
``OMP_NUM_THREADS=1``): on a machine other jobs share, the work each system does, whoever holds the cores.
On the CPU each row has its model FLOPs utilisation: texts/s x the texts' mean real tokens x forward FLOPs per
token (``common.encoder_flops_per_token``) / the CPU's measured bf16 peak (``cpu_peak.py``: AMX tiles' where the
CPU has them; float32 without AVX512-BF16), one peak for every row, so each system's distance to the hardware limit
shows.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from common import (
    encoder_flops_per_token,
    environment,
    markdown_table,
    output_file,
    pick_device,
    print_profile,
    rate,
    timer,
    write_json,
)
from densepass.data import load_dataset
from densepass.device import cpu_has_fast_bf16, resolve_precision
from densepass.models import copies as copies_module
from densepass.models import cpu_kernels as kernels_module
from densepass.models import fused as fused_module
from densepass.models import inputs as inputs_module
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path
from densepass.models.encode import encode_texts
from densepass.models.inputs import CPU_PIECE_TOKENS

Encoder = Callable[[list[str]], np.ndarray]
PLURAL = {"passage": "passages", "query": "queries"}


def under(module: ModuleType, settings: dict, encode: Encoder) -> Encoder:
    """``encode`` run with ``module``'s module-level ``settings`` (name -> value) in place meanwhile: a densepass
    setting to compare with its default."""

    def run(items: list[str]) -> np.ndarray:
        before = {name: getattr(module, name) for name in settings}
        for name, value in settings.items():
            setattr(module, name, value)
        try:
            return encode(items)
        finally:
            for name, value in before.items():
                setattr(module, name, value)

    return run


def load_st(path: str, device: torch.device, max_length: int, dtype=torch.float32, **options):
    """A SentenceTransformer of ``path`` cut at ``max_length`` tokens (``options``: backend, model_kwargs)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device=str(device), **options)
    if options.get("backend", "torch") == "torch":
        model = model.to(dtype)
    model.max_seq_length = max_length
    return model


def densepass_encoder(model: BiEncoder, options: dict) -> Encoder:
    """densepass ``encode_texts`` with ``options`` (side, batch size, device, precision, ...) as an encoder."""
    return lambda items: encode_texts(model, items, **options)


def st_encoder(model, batch: int) -> Encoder:
    """``model.encode`` at batch size ``batch`` as an encoder."""
    return lambda items: np.asarray(
        model.encode(items, batch_size=batch, convert_to_numpy=True, show_progress_bar=False), dtype=np.float32
    )


def cpu_quantization_target() -> str:
    """sentence-transformers' ONNX quantisation config for this CPU: avx512_vnni, avx512 or avx2."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    return "avx512_vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags else "avx2"


def st_backend_encoders(path: str, work: Path, device: torch.device, args) -> dict[str, Encoder | str]:
    """sentence-transformers' ONNX (fp32, int8) and OpenVINO backends, exported from a copy of the model's
    files in ``work``: name -> encoder, or -> why it could not run."""
    out: dict[str, Encoder | str] = {}
    copy = work / "st-model"
    shutil.copytree(path, copy, dirs_exist_ok=True)
    for backend in args.st_backends:
        try:
            model = load_st(str(copy), device, args.max_length, backend=backend)
            out[f"SentenceTransformer.encode backend={backend}|fp32"] = st_encoder(model, 32)
            if backend == "onnx":
                from sentence_transformers import export_dynamic_quantized_onnx_model

                target = cpu_quantization_target()
                model.save_pretrained(str(copy))  # the exported model.onnx beside the original files
                export_dynamic_quantized_onnx_model(model, target, str(copy))
                quantized = load_st(
                    str(copy),
                    device,
                    args.max_length,
                    backend="onnx",
                    model_kwargs={"file_name": f"onnx/model_qint8_{target}.onnx"},
                )
                out[f"SentenceTransformer.encode backend=onnx|int8 ({target})"] = st_encoder(quantized, 32)
        except Exception as err:  # an optional backend that does not install or export here: recorded, not fatal
            out[f"SentenceTransformer.encode backend={backend}"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return out


class LastHidden(torch.nn.Module):
    """A ``transformers`` encoder as a function of (input ids, attention mask) -> last hidden states, for export."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states [batch, length, width]."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def exported_encoder(run: Callable[[dict[str, np.ndarray]], np.ndarray], tokenizer, args) -> Encoder:
    """An exported transformer (``run``: int64 token arrays -> last hidden states) encoding as
    sentence-transformers' ONNX / OpenVINO backends do: batches of ``--export-batch-size`` texts, longest first,
    padded to their longest, mean-pooled and normalised; the rows put back in input order."""

    def encode(items: list[str]) -> np.ndarray:
        order = np.argsort([-len(t) for t in items], kind="stable")
        out = []
        for start in range(0, len(items), args.export_batch_size):
            tokens = tokenizer(
                [items[i] for i in order[start : start + args.export_batch_size]],
                truncation=True,
                max_length=args.max_length,
                padding=True,
                return_tensors="np",
                return_token_type_ids=False,
            )
            hidden = run({k: v.astype(np.int64) for k, v in tokens.items()})
            mask = tokens["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
            out.append(pooled / np.linalg.norm(pooled, axis=1, keepdims=True))
        embeddings = np.empty((len(items), out[0].shape[1]), dtype=np.float32)
        embeddings[order] = np.concatenate(out)
        return embeddings

    return encode


def ort_encoders(path: str, work: Path, args) -> dict[str, Encoder | str]:
    """The model's transformer exported with ``torch.onnx`` and run by ONNX Runtime, fp32 and dynamic int8
    (what sentence-transformers' ONNX backend runs)."""
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:
        return {"ONNX Runtime (torch.onnx export)": f"ImportError: {err}"}

    fp32_file, int8_file = work / "model.onnx", work / "model-int8.onnx"
    example = (torch.ones(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.long))
    dynamic = {name: {0: "batch", 1: "tokens"} for name in ("input_ids", "attention_mask", "hidden")}
    torch.onnx.export(
        LastHidden(AutoModel.from_pretrained(path).eval()),
        example,
        str(fp32_file),
        input_names=["input_ids", "attention_mask"],
        output_names=["hidden"],
        dynamic_axes=dynamic,
        opset_version=17,
        dynamo=False,
    )
    quantize_dynamic(str(fp32_file), str(int8_file), weight_type=QuantType.QInt8, per_channel=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()

    def encoder(file: Path) -> Encoder:
        session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
        return exported_encoder(lambda tokens: session.run(None, tokens)[0], tokenizer, args)

    return {
        "ONNX Runtime (torch.onnx export)|fp32": encoder(fp32_file),
        "ONNX Runtime (torch.onnx export)|int8": encoder(int8_file),
    }


def openvino_encoders(path: str, args) -> dict[str, Encoder | str]:
    """The model's transformer converted by OpenVINO (``openvino.convert_model``) and run by its CPU plugin in f32
    and, where the CPU has fast bf16, bf16 (the plugin's own default there): what sentence-transformers' OpenVINO
    backend runs."""
    try:
        import openvino as ov
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:
        return {"OpenVINO (convert_model)": f"ImportError: {err}"}

    example = {name: torch.ones(2, 16, dtype=torch.long) for name in ("input_ids", "attention_mask")}
    model = ov.convert_model(LastHidden(AutoModel.from_pretrained(path).eval()), example_input=example)
    tokenizer, core = AutoTokenizer.from_pretrained(path), ov.Core()
    out: dict[str, Encoder | str] = {}
    for name, hint in [("fp32", "f32")] + ([("bf16", "bf16")] if cpu_has_fast_bf16() else []):
        settings = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": torch.get_num_threads()}
        request = core.compile_model(model, "CPU", settings).create_infer_request()
        label = f"OpenVINO {ov.__version__.split('-')[0]} (convert_model)|{name}"
        out[label] = exported_encoder(lambda tokens, r=request: r.infer(tokens)[0], tokenizer, args)
    return out


EMBEDDINGS_MARK = ".bench-encode-embeddings"  # in a folder whose passages.npy and queries.npy this script wrote


def embeddings_folder(value: str) -> str:
    """argparse type of ``--save-embeddings``: a folder where the .npy files this script writes are missing, or its
    own (the folder holds ``EMBEDDINGS_MARK``), checked before any work."""
    folder = Path(value)
    taken = [name for name in ("passages.npy", "queries.npy") if (folder / name).exists()]
    if taken and not (folder / EMBEDDINGS_MARK).is_file():
        raise argparse.ArgumentTypeError(
            f"{folder} holds {', '.join(taken)} that this script did not write; it overwrites only its own"
        )
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument(
        "--side",
        choices=["passage", "query"],
        default="passage",
        help="encode the corpus's passages, or the split's dev queries (short inputs)",
    )
    parser.add_argument("--n", type=int, default=None, help="texts to encode (default: all on GPU, 2000 on CPU)")
    parser.add_argument("--batch-size", type=int, default=512, help="densepass batch size")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per text (densepass's max length)")
    parser.add_argument("--warm-up", type=int, default=512, help="texts each system encodes before it is timed")
    parser.add_argument("--repeats", type=int, default=1, help="timed encodings per system; the fastest is reported")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU: time each system by the process's CPU seconds (all its threads) instead of the clock: on a machine "
        "other jobs share, with OMP_NUM_THREADS=1, the work each system does whoever holds the cores (not a "
        "wall-clock claim)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: each densepass setting's encoding under torch.profiler, the ops by self CPU time",
    )
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="CPU: densepass bf16 also as before the fused layers (transformers' layers, 2,048-token pieces)",
    )
    parser.add_argument(
        "--sdpa",
        action="store_true",
        help="CPU: densepass bf16 also with SDPA in the fused layers instead of the AMX attention kernel",
    )
    parser.add_argument(
        "--bf16-piece-tokens",
        type=int,
        nargs="*",
        default=[],
        help="CPU: densepass bf16 also at these piece sizes (tokens; the default is BF16_PIECE_TOKENS)",
    )
    parser.add_argument(
        "--length-multiples",
        type=int,
        nargs="*",
        default=[],
        help="CPU: densepass bf16 also with the fused layers' inputs padded to these multiples where that adds at "
        "most 1 / models.fused.PAD_SHARE (1: not padded; the default is models.fused.LENGTH_MULTIPLE)",
    )
    parser.add_argument(
        "--densepass-precisions",
        nargs="+",
        default=None,
        help="densepass precisions (default: fp32, bf16 where the device has it natively, int8 on CPU)",
    )
    parser.add_argument(
        "--st-batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="sentence-transformers batch sizes (default: 32, its default, and --batch-size)",
    )
    parser.add_argument(
        "--st-backends",
        nargs="*",
        default=["onnx", "openvino"],
        help="CPU: sentence-transformers backends besides torch, where they install (run at batch 32)",
    )
    parser.add_argument("--ort", action="store_true", help="CPU: also ONNX Runtime on a torch.onnx export")
    parser.add_argument(
        "--openvino", action="store_true", help="CPU: also OpenVINO on the model converted by openvino.convert_model"
    )
    parser.add_argument("--export-batch-size", type=int, default=32, help="--ort, --openvino: batch size")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--save-embeddings",
        type=embeddings_folder,
        default=None,
        help="directory for densepass's passages.npy and dev queries.npy (for bench_search.py)",
    )
    parser.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = parser.parse_args()
    sizes = [args.repeats, args.export_batch_size, *args.bf16_piece_tokens, *args.length_multiples]
    if any(size < 1 for size in sizes) or (args.n is not None and args.n < 1):
        parser.error("--n, --repeats, --export-batch-size, --bf16-piece-tokens and --length-multiples must be >= 1")
    if args.save_embeddings and args.side != "passage":
        parser.error("--save-embeddings saves passage embeddings: run it with --side passage")
    device = pick_device(args.device)
    gpu = device.type == "cuda"
    env = environment(device)
    print(
        f"device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"sentence-transformers {env['sentence_transformers']}; {env['cpu_model']} ({' '.join(env['cpu_flags'])}), "
        f"densepass's CPU kernels: {env['cpu_kernels'] or 'none'}, load average {env['load_average']}"
    )
    precisions = args.densepass_precisions or (
        ["bf16", "fp32"]
        if gpu
        else ["fp32", *(["bf16"] if resolve_precision("auto", device) == "bf16" else []), "int8"]
    )
    for precision in precisions:
        resolve_precision(precision, device)  # int8 on a GPU fails before any work

    path = resolve_model_path(args.model)
    lengths = BiEncoderConfig(query_max_length=args.max_length, passage_max_length=args.max_length)
    model = BiEncoder.from_pretrained(path, config=lengths)
    dataset = load_dataset(args.dataset, args.data_dir)
    dev = [dataset.queries[q] for q in sorted(dataset.positives("dev"))]
    texts = dataset.corpus.passage_inputs(model.tokenizer.sep_token) if args.side == "passage" else dev
    n = args.n or (len(texts) if gpu else 2000)
    texts = texts[:n]
    warm = texts[: args.warm_up]
    print(f"{len(texts):,} {args.dataset} {PLURAL[args.side]}, max {args.max_length} tokens\n")

    systems: list[tuple[str, str, int, Encoder]] = []  # (system, precision, batch size, encoder)
    options = {"side": args.side, "batch_size": args.batch_size, "device": device, "show_progress": False}
    for precision in precisions:
        encode = densepass_encoder(model, {**options, "precision": precision})
        systems.append(("densepass encode_texts", precision, args.batch_size, encode))
    bf16_options = {**options, "precision": "bf16"}
    for tokens in args.bf16_piece_tokens if not gpu else []:
        encode = under(inputs_module, {"BF16_PIECE_TOKENS": tokens}, densepass_encoder(model, bf16_options))
        systems.append((f"densepass encode_texts, pieces of {tokens:,} tokens", "bf16", args.batch_size, encode))
    for multiple in args.length_multiples if not gpu else []:
        encode = under(fused_module, {"LENGTH_MULTIPLE": multiple}, densepass_encoder(model, bf16_options))
        label = f"densepass encode_texts, lengths padded to a multiple of {multiple}"
        systems.append((label, "bf16", args.batch_size, encode))
    if args.sdpa and not gpu:
        encode = under(kernels_module, {"usable": lambda qkv, size: False}, densepass_encoder(model, bf16_options))
        systems.append(("densepass encode_texts, SDPA attention", "bf16", args.batch_size, encode))
    if args.unfused and not gpu:
        # a model of its own: its bf16 copy is made while fusion is off (copies are cached per model)
        unfused = BiEncoder.from_pretrained(path, config=lengths)
        encode = densepass_encoder(unfused, bf16_options)
        encode = under(inputs_module, {"BF16_PIECE_TOKENS": CPU_PIECE_TOKENS}, encode)
        encode = under(copies_module, {"fusable": lambda tower: False}, encode)
        systems.append(
            ("densepass encode_texts, transformers' layers, pieces of 2,048", "bf16", args.batch_size, encode)
        )
    if args.profile:
        for system, dtype, batch, encode in systems:
            encode(warm)
            print(f"\n{system} {dtype} batch {batch}:")
            print_profile(lambda e=encode: e(texts), device)
        return
    st_batches = args.st_batch_sizes or sorted({32, args.batch_size})
    st_bf16 = gpu or cpu_has_fast_bf16()  # a bfloat16 copy is sentence-transformers' fast setting there too
    for name, dtype in [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if st_bf16 else []):
        st = load_st(path, device, args.max_length, dtype)
        systems.extend(("SentenceTransformer.encode", name, batch, st_encoder(st, batch)) for batch in st_batches)
    skipped = {}
    with tempfile.TemporaryDirectory() as tmp:
        others = st_backend_encoders(path, Path(tmp), device, args) if args.st_backends and not gpu else {}
        if args.ort and not gpu:
            others.update(ort_encoders(path, Path(tmp), args))
        if args.openvino and not gpu:
            others.update(openvino_encoders(path, args))
        for label, encoder in others.items():
            if isinstance(encoder, str):
                skipped[label] = encoder
                print(f"  {label}: not run ({encoder})", flush=True)
                continue
            system, dtype = label.split("|")
            exported = system.startswith(("ONNX", "OpenVINO"))
            systems.append((system, dtype, args.export_batch_size if exported else 32, encoder))
        results, embeddings = measure_in_turn(
            systems, warm, texts, device, args.repeats, PLURAL[args.side], args.cpu_time and not gpu
        )
    if args.save_embeddings:
        out_dir = Path(args.save_embeddings)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / EMBEDDINGS_MARK).write_text("")
        np.save(out_dir / "passages.npy", embeddings[f"densepass encode_texts|{precisions[0]}|{args.batch_size}"])
        queries = encode_texts(model, dev, "query", device=device, precision=precisions[0], show_progress=False)
        np.save(out_dir / "queries.npy", queries)
        print(f"  saved {len(texts):,} passage and {len(dev):,} dev query embeddings in {out_dir}")
    env["utilisation"] = utilisation(path, model.tokenizer, texts, args.max_length, gpu)
    report(args, env, len(texts), results, embeddings, skipped)


def utilisation(path: str, tokenizer, texts: list[str], max_length: int, gpu: bool) -> dict:
    """What MFU divides: the texts' mean real tokens (truncated at ``max_length``, special tokens included), the
    forward FLOPs per token (``common.encoder_flops_per_token``) and, on the CPU, its measured bf16 peak
    (``cpu_peak.py``; float32 where the CPU has no AVX512-BF16). No peak on a GPU (None)."""
    import cpu_peak

    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    mean_length = float(np.mean(lengths))
    peak, how = (None, "GPU: not measured") if gpu else cpu_peak.peak_tflops(bf16=True)
    if peak is None and not gpu:
        peak, how = cpu_peak.peak_tflops(bf16=False)
    flops = encoder_flops_per_token(path, mean_length)
    return {"mean_tokens": mean_length, "flops_per_token": flops, "peak_tflops": peak, "peak_source": how}


def measure_in_turn(
    systems: list[tuple[str, str, int, Encoder]],
    warm: list[str],
    texts: list[str],
    device: torch.device,
    repeats: int,
    unit: str,
    cpu_time: bool = False,
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Each system encodes ``warm`` (untimed), then ``texts`` ``repeats`` times, the systems in turn (a drift in
    the machine's speed reaches each of them alike); each one's fastest time and every round's. Returns the
    result rows and each system's embeddings (key ``system|precision|batch``); ``unit``: what the texts are, for
    the printout; ``cpu_time``: the process's CPU seconds instead of the clock's (``--cpu-time``)."""
    for _, _, _, encode in systems:
        encode(warm)
    rounds, embeddings = [[] for _ in systems], {}
    for _ in range(repeats):
        for i, (system, dtype, batch, encode) in enumerate(systems):
            started = time.process_time()
            with timer(device) as took:
                embeddings[f"{system}|{dtype}|{batch}"] = np.asarray(encode(texts), dtype=np.float32)
            seconds = time.process_time() - started if cpu_time else took()
            rounds[i].append(seconds)
            clock = "CPU s" if cpu_time else "s"
            rate_ = f"{len(texts) / seconds:,.0f} {unit}/{clock}"
            print(f"  {system} {dtype} batch {batch}: {seconds:.2f} {clock}, {rate_}", flush=True)
    results = [
        {
            "system": system, "dtype": dtype, "batch_size": batch, "seconds": min(times),
            "texts_per_s": len(texts) / min(times), "rounds_seconds": times,
        }
        for (system, dtype, batch, _), times in zip(systems, rounds)
    ]  # fmt: skip
    return results, embeddings


def report(args, env: dict, n: int, results: list[dict], embeddings: dict[str, np.ndarray], skipped: dict) -> None:
    """The table, the speed-ups that matter and the agreement with sentence-transformers fp32; the JSON."""
    ours = results[0]
    st_rows = [r for r in results if not r["system"].startswith("densepass")]
    st_default = next(
        (r for r in st_rows if r["system"] == "SentenceTransformer.encode" and r["dtype"] == "fp32"), st_rows[0]
    )
    reference = embeddings[f"{st_default['system']}|{st_default['dtype']}|{st_default['batch_size']}"]
    agreement = {key: float(np.mean(np.sum(v * reference, axis=1))) for key, v in embeddings.items()}
    used = env["utilisation"]
    for r in results:
        r["mean_cosine_vs_st_fp32"] = agreement[f"{r['system']}|{r['dtype']}|{r['batch_size']}"]
        tflops = r["texts_per_s"] * used["mean_tokens"] * used["flops_per_token"] / 1e12
        r["mfu"] = tflops / used["peak_tflops"] if used["peak_tflops"] else None
    rows = [
        [
            r["system"] + (" **(densepass)**" if r is ours else ""),
            r["dtype"],
            r["batch_size"],
            f"{r['seconds']:.2f}",
            rate(r["texts_per_s"]),
            f"{ours['texts_per_s'] / r['texts_per_s']:.2f}x",
            f"{r['mean_cosine_vs_st_fp32']:.5f}",
            "-" if r["mfu"] is None else f"{100 * r['mfu']:.0f}%",
        ]
        for r in results
    ]
    print()
    print(
        markdown_table(
            [
                "system",
                "dtype",
                "batch",
                "CPU seconds" if args.cpu_time else "seconds",
                f"{PLURAL[args.side]}/{'CPU s' if args.cpu_time else 's'}",
                "densepass first row ÷ row",
                "cosine to ST fp32",
                "MFU",
            ],
            rows,
        )
    )
    if used["peak_tflops"]:
        print(
            f"MFU: {used['mean_tokens']:.1f} real tokens a text x {used['flops_per_token'] / 1e6:.1f} MFLOPs a token "
            f"x texts/s / {used['peak_tflops']:.3f} TFLOPS ({used['peak_source']})"
        )
    best_ours = max((r for r in results if r["system"].startswith("densepass")), key=lambda r: r["texts_per_s"])
    best_st = max(st_rows, key=lambda r: r["texts_per_s"])
    per_round = [other / mine for mine, other in zip(best_ours["rounds_seconds"], best_st["rounds_seconds"])]
    speedups = {
        "first_densepass_vs_st_default": ours["texts_per_s"] / st_default["texts_per_s"],
        "best_densepass_vs_best_other": best_ours["texts_per_s"] / best_st["texts_per_s"],
        "best_densepass_vs_best_other_per_round": per_round,
    }
    print(
        f"\ndensepass {ours['dtype']} / sentence-transformers default (fp32, batch {st_default['batch_size']}): "
        f"{speedups['first_densepass_vs_st_default']:.2f}x\nfastest densepass ({best_ours['dtype']}) / fastest other "
        f"system ({best_st['system']} {best_st['dtype']} batch {best_st['batch_size']}): "
        f"{speedups['best_densepass_vs_best_other']:.2f}x (compare at equal quality: the cosine column); round by "
        f"round (each round's two times): median {np.median(per_round):.2f}x, {min(per_round):.2f}x to "
        f"{max(per_round):.2f}x"
    )
    for label, why in skipped.items():
        print(f"not run: {label}: {why}")
    write_json(
        args.out,
        {
            "benchmark": "encode",
            **env,
            "model": args.model,
            "dataset": args.dataset,
            "side": args.side,
            "n_texts": n,
            "max_length": args.max_length,
            "timed_by": "process CPU seconds" if args.cpu_time else "wall-clock seconds",
            "results": results,
            "speedups": speedups,
            "not_run": skipped,
        },
    )


if __name__ == "__main__":
    main()
