r"""The ONNX export (``densepass export --to onnx``): how close its embeddings are to the model's, and how fast ONNX
Runtime encodes with it on the CPU against densepass on the same model, same passages, same batches, in one run.

    python benchmarks/bench_export.py --n 1000 --out outputs/bench/export-cpu.json

The model (default all-MiniLM-L6-v2) is saved, then exported with ``densepass.pipelines.export.export_model``;
``--n`` debian-packages passages (``title [SEP] text``) are encoded by densepass (``encode_passages`` in fp32 and
in ``auto``: bf16 where the CPU has fast bf16) and by an ONNX Runtime session of the exported graph (batches of
``--batch-size``, sorted by length as densepass sorts them, all threads). ``--repeats`` rounds run the systems in
turn; each one's fastest time is reported, and the ratio of ONNX Runtime's rate to densepass's fastest setting.
Agreement: the largest absolute difference and the smallest cosine between the ONNX and fp32 embeddings.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from common import environment, markdown_table, output_file, rate, timer, write_json
from densepass.data import load_dataset
from densepass.models.biencoder import BiEncoder
from densepass.pipelines.export import export_model

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--n", type=int, default=1000, help="passages encoded")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=output_file, default=None, help="a JSON file for the results")
    args = parser.parse_args()

    import onnxruntime

    model = BiEncoder.from_pretrained(args.model)
    corpus = load_dataset(args.dataset, args.data_dir).corpus
    texts = corpus.passage_inputs(model.tokenizer.sep_token or " ")[: args.n]
    with tempfile.TemporaryDirectory() as tmp:
        model.save(Path(tmp) / "model")
        exported = export_model(Path(tmp) / "model", "onnx", str(Path(tmp) / "onnx"))
        session = onnxruntime.InferenceSession(
            str(Path(tmp) / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        order = np.argsort([-len(t) for t in texts], kind="stable")
        batches = [
            model.tokenize([texts[i] for i in order[lo : lo + args.batch_size]], "passage")
            for lo in range(0, len(texts), args.batch_size)
        ]  # tokenised once, outside the timing: both systems are timed on the encoder alone

        def run_onnx() -> np.ndarray:
            out = np.concatenate(
                [session.run(None, {k: b[k].numpy() for k in ("input_ids", "attention_mask")})[0] for b in batches]
            )
            return out[np.argsort(order)]

        systems = {
            "densepass fp32": lambda: model.encode_passages(texts, args.batch_size, False, precision="fp32"),
            "densepass auto": lambda: model.encode_passages(texts, args.batch_size, False, precision="auto"),
            "ONNX Runtime (exported graph)": run_onnx,
        }
        for run in systems.values():  # warm-up, not timed
            run()
        best = {name: float("inf") for name in systems}
        outputs = {}
        for _ in range(args.repeats):
            for name, run in systems.items():
                with timer(CPU) as elapsed:
                    outputs[name] = run()
                best[name] = min(best[name], elapsed())
    reference, onnx = outputs["densepass fp32"], outputs["ONNX Runtime (exported graph)"]
    cosine = (reference * onnx).sum(1) / np.linalg.norm(reference, axis=1) / np.linalg.norm(onnx, axis=1)
    fastest_densepass = min(best["densepass fp32"], best["densepass auto"])
    ratio = fastest_densepass / best["ONNX Runtime (exported graph)"]
    rows = [[name, rate(len(texts) / seconds), f"{seconds:.2f}"] for name, seconds in best.items()]
    print(markdown_table(["system", "passages/s", "seconds"], rows))
    print(
        f"ONNX Runtime / densepass (fastest setting): {ratio:.2f}x; "
        f"agreement with densepass fp32: max abs diff {np.abs(reference - onnx).max():.2e}, "
        f"min cosine {cosine.min():.6f} (the export's own check: {exported.max_abs_diff:.2e})"
    )
    write_json(
        args.out,
        {
            "environment": environment(CPU),
            "n": len(texts),
            "seconds": best,
            "max_abs_diff": float(np.abs(reference - onnx).max()),
            "min_cosine": float(cosine.min()),
        },
    )


if __name__ == "__main__":
    main()
