"""``densepass export MODEL --to dir|onnx|hub TARGET``: publish a saved model with a generated model card.

- ``dir``: the model's files and a ``README.md`` model card in a new folder (or one densepass wrote);
- ``onnx``: ``model.onnx`` whose graph holds the whole bi-encoder (transformer, pooling, projection, normalisation:
  ``input_ids`` and ``attention_mask`` in, ``sentence_embedding`` out), its tokenizer files and the card; checked
  with ONNX Runtime against the PyTorch embeddings of sample texts before it is kept (cosine >= 0.9999);
- ``hub``: the ``dir`` export uploaded to a Hugging Face repo with ``huggingface_hub`` (created when missing; the
  token from ``HF_TOKEN`` or ``huggingface-cli login``).

The card says what the model is (kind, base model, pooling, prompts, dimensions), how it was trained (the run's
``config.yaml`` beside the model, when it is a run's ``model/``), what it scored (the run's metrics), how to load
it in sentence-transformers and densepass, and what to cite (the references of the methods the run used).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from densepass.errors import ConfigError
from densepass.io import atomic_directory, atomic_write_text, check_replaceable
from densepass.models.biencoder import BiEncoder
from densepass.models.hub import hub_id
from densepass.models.load import kind_of, load_model

TARGETS = ("dir", "onnx", "hub")
CHECK_TEXTS = [
    "tar: GNU version of the tar archiving utility",
    "audio editor",
    "a multimedia player and streamer that plays most audio and video formats, DVDs, CDs and network streams",
    "x",
]
MIN_COSINE = 0.9999
# what the card cites, by the methods a run used (short names and works as in docs/references.md)
REFERENCES = {
    "dpr": "Karpukhin et al. Dense Passage Retrieval for Open-Domain Question Answering. EMNLP 2020. arXiv:2004.04906",
    "negative-contrast": "Lu et al. Neural Passage Retrieval with Improved Negative Contrast. 2020. arXiv:2010.12523",
    "abs-condenser-openqa": "Zhao, Yang, Cui. Condenser and Adaptive Batch Scheduling for OpenQA Passage Retrieval.",
    "gradcache": "Gao et al. Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup. arXiv:2101.06983",
    "margin-mse": "Hofstätter et al. Cross-Architecture Knowledge Distillation. arXiv:2010.02666",
    "splade": "Formal, Piwowarski, Clinchant. SPLADE. SIGIR 2021. arXiv:2107.05720",
    "colbert": "Khattab, Zaharia. ColBERT. SIGIR 2020. arXiv:2004.12832",
    "lora": "Hu et al. LoRA: Low-Rank Adaptation of Large Language Models. ICLR 2022. arXiv:2106.09685",
}


@dataclass
class ExportResult:
    """Where the export went, and for ONNX how close its embeddings are to PyTorch's."""

    target: str
    max_abs_diff: float | None = None
    min_cosine: float | None = None


def model_card(model_dir: Path, model, onnx: bool = False) -> str:
    """The README.md of an exported model (see the module docstring); ``onnx``: of the ONNX export, which neither
    densepass nor sentence-transformers loads, so its usage is onnxruntime's."""
    kind = kind_of(model)
    config = model.config
    run = model_dir.parent
    run_config = _read_yaml(run / "config.yaml") if (run / "config.yaml").is_file() else None
    metrics = _read_json(run / "metrics.json") if (run / "metrics.json").is_file() else None
    # what it started from: the run's model, else (no run beside it) where it was loaded from, if a Hub name
    base = public_name(
        run_config.get("model", {}).get("name_or_path") if run_config else getattr(model, "source", None)
    )
    library = "onnx" if onnx else "sentence-transformers"
    lines = ["---", f"library_name: {library}", f"tags: [densepass, {library}, retrieval]"]
    lines += ["pipeline_tag: sentence-similarity", "---", "", f"# {model_dir.name}", ""]
    lines.append(f"A {kind} retriever trained with densepass from `{base}`." if base else f"A {kind} retriever.")
    lines += ["", "## Model", "", "| | |", "|---|---|", f"| kind | {kind} |"]
    for key in ("pooling", "normalize", "projection_dim", "query_max_length", "passage_max_length"):
        if hasattr(config, key):
            lines.append(f"| {key} | {getattr(config, key)} |")
    for key in ("query_prompt", "passage_prompt"):
        if getattr(config, key, ""):
            lines.append(f"| {key} | {code_cell(getattr(config, key))} |")
    if isinstance(model, BiEncoder):
        lines.append(f"| dimensions | {model.dim} |")
    cited = ["dpr"]
    if run_config is not None:
        train, data, neg = run_config.get("train", {}), run_config.get("data", {}), run_config.get("negatives", {})
        dataset = public_name(data.get("name"))
        dataset = f"`{dataset}`" if dataset else "a local dataset"
        lines += ["", "## Training", "", f"- data: {dataset} (split `{data.get('train_split', 'train')}`)"]
        pool = f"pool {neg.get('pool_depth')}, {neg.get('per_query')} a step"
        lines.append(f"- hard negatives: {neg.get('source')} ({pool})")
        keys = ("epochs", "max_steps", "batch_size", "learning_rate", "warmup_ratio", "lora_rank", "wise_ft")
        lines.append("- " + ", ".join(f"{k} {train[k]}" for k in keys if train.get(k) not in (None, 0)))
        lines.append("- the whole config: `config.yaml` of the run (`densepass run config.yaml` reproduces it)")
        cited += ["negative-contrast"] if neg.get("source") not in (None, "none") else []
        schedule = str(run_config.get("schedule", {}).get("method", ""))
        cited += ["abs-condenser-openqa"] if schedule.startswith("abs") else []
        cited += ["gradcache"] if train.get("grad_cache_chunk") else []
        cited += ["lora"] if train.get("lora_rank") else []
    cited += [k for k in ("splade", "colbert") if k == kind]
    if metrics and isinstance(metrics.get("results"), dict):
        names = sorted({m for row in metrics["results"].values() for m in row})
        evaluated = public_name(metrics.get("dataset"))
        evaluated = f"`{evaluated}`" if evaluated else "a local dataset"
        lines += ["", "## Results", "", f"On {evaluated} ({metrics.get('eval', 'dev')}):", ""]
        lines += ["| system | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for system, row in metrics["results"].items():
            lines.append(f"| {system} | " + " | ".join(f"{row[m]:.4f}" if m in row else "" for m in names) + " |")
    lines += ["", "## Use", ""] + (_onnx_usage(model) if onnx else _usage(model, kind)) + ["", "## Cite", ""]
    lines += [f"- {REFERENCES[key]}" for key in dict.fromkeys(cited)]
    return "\n".join(lines) + "\n"


def public_name(name: object) -> str | None:
    """``name`` (a model or dataset a run started from) where it is written as a Hub id and is no folder here:
    a card never publishes a path of the machine the model was trained on."""
    if not isinstance(name, str) or hub_id(name) is None or Path(name).expanduser().exists():
        return None
    return name


def code_cell(text: str) -> str:
    """``text`` as a code span of a Markdown table cell: quoted as JSON (a newline written ``\\n``, trailing
    spaces seen), ``|`` escaped, fenced by one backtick more than its longest run of them."""
    quoted = json.dumps(text, ensure_ascii=False).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall("`+", quoted)), default=0) + 1)
    return f"{fence}{quoted}{fence}"


def _onnx_usage(model: BiEncoder) -> list[str]:
    """The ONNX export's usage: its graph is the passage side (tokens in, the pooled, projected, normalised vector
    out), so a query is given its prompt and cut at its own token limit before it goes in."""
    config = model.config
    query_prompt, passage_prompt = config.query_prompt or "", config.passage_prompt or ""
    return [
        "```python",
        "import onnxruntime",
        "from transformers import AutoTokenizer",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        'session = onnxruntime.InferenceSession("PATH/model.onnx")',
        "",
        "def embed(texts, max_length):",
        '    tokens = tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_tensors="np")',
        '    feed = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}',
        "    return session.run(None, feed)[0]  # sentence_embedding: one row a text",
        "",
        f'queries = embed([{query_prompt!r} + "a question"], max_length={config.query_max_length})',
        f'passages = embed([{passage_prompt!r} + "a passage"], max_length={config.passage_max_length})',
        "```",
        "",
        "The graph holds the passage side of the model (one shared tower); queries run through it with their own "
        "prompt and token limit, as above.",
    ]


def _usage(model, kind: str) -> list[str]:
    """The card's usage lines: densepass for every kind; sentence-transformers for a bi-encoder, as it loads the
    export (two towers: the query tower is its own model under ``query/``; one tower: one token limit, the
    passages', where densepass cuts queries at theirs)."""
    lines = ["```python", "import densepass as dp", "", 'model = dp.load_model("PATH_OR_REPO")']
    lines += [
        'queries = model.encode_queries(["a question"])',
        'passages = model.encode_passages(["a passage"])',
        "```",
    ]
    if not isinstance(model, BiEncoder):
        return lines
    config = model.config
    lines += [
        "",
        "In sentence-transformers:",
        "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
    ]
    if config.shared:
        lines += ['model = SentenceTransformer("PATH_OR_REPO")', 'queries = model.encode_query(["a question"])']
    else:
        lines += ['query_model = SentenceTransformer("PATH/query")  # the query tower (of a local copy)']
        lines += ['queries = query_model.encode_query(["a question"])', 'model = SentenceTransformer("PATH_OR_REPO")']
    lines += ['passages = model.encode_document(["a passage"])', "```"]
    if config.shared and config.query_max_length < config.passage_max_length:
        lines += [
            "",
            f"sentence-transformers cuts every text at {config.passage_max_length} tokens: queries longer than "
            f"{config.query_max_length} tokens, which densepass cuts there, embed differently.",
        ]
    return lines


def export_model(model_path: str | Path, to: str, target: str, private: bool = False) -> ExportResult:
    """Export the saved model at ``model_path`` (see the module docstring); every refusal before any work."""
    if to not in TARGETS:
        raise ConfigError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    model_dir = Path(model_path)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir} is not a saved model directory")
    if to != "hub":
        out = Path(target).resolve()
        if out == model_dir.resolve() or model_dir.resolve() in out.parents:
            raise ConfigError(f"the export {target} would be inside the model it exports; choose another path")
        check_replaceable(target, "the export")  # a folder of the user's: refused before the model loads
    if to == "hub":
        check_repo_id(target)
    model = load_model(str(model_dir))
    if to == "onnx" and not isinstance(model, BiEncoder) or to == "onnx" and not model.config.shared:
        raise ConfigError("--to onnx exports bi-encoders with one shared tower (pooling inside the graph)")
    if to == "hub":
        return _to_hub(model_dir, model, target, private)
    with atomic_directory(target) as tmp:
        if to == "dir":
            _copy_model(model_dir, tmp)
            result = ExportResult(str(target))
        else:
            result = _to_onnx(model, tmp, str(target))
        atomic_write_text(tmp / "README.md", model_card(model_dir, model, onnx=to == "onnx"))
    return result


def _copy_model(model_dir: Path, out: Path) -> None:
    for item in model_dir.iterdir():
        if item.name.startswith(".densepass"):
            continue  # the ownership list is written for the new folder
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)


class _Embedder(torch.nn.Module):
    """The bi-encoder's passage side as one graph: tokens in, pooled, projected, normalised vectors out."""

    def __init__(self, model: BiEncoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask, "passage")


def _to_onnx(model: BiEncoder, out: Path, target: str) -> ExportResult:
    try:
        import onnxruntime
        import onnxscript  # noqa: F401  (torch's ONNX exporter needs it)
    except ImportError:
        raise ConfigError("--to onnx needs onnx, onnxscript and onnxruntime: pip install 'densepass[export]'") from None
    from torch.export import Dim

    model = model.float().eval()
    example = model.tokenize(CHECK_TEXTS[:2], "passage")
    batch, sequence = Dim("batch"), Dim("sequence", max=model.max_length("passage"))
    shapes = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: sequence}}
    with torch.no_grad():
        torch.onnx.export(
            _Embedder(model),
            (example["input_ids"], example["attention_mask"]),
            str(out / "model.onnx"),
            input_names=["input_ids", "attention_mask"],
            output_names=["sentence_embedding"],
            dynamic_shapes=shapes,
            dynamo=True,
        )
    # the graph takes at most the passages' token limit: a tokenizer saved with its own (512) would make inputs
    # the graph refuses ("invalid expand shape") out of any text truncated by default
    limit, model.tokenizer.model_max_length = model.tokenizer.model_max_length, model.max_length("passage")
    try:
        model.tokenizer.save_pretrained(out)
    finally:
        model.tokenizer.model_max_length = limit
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    tokens = model.tokenize(CHECK_TEXTS, "passage")
    ours = session.run(None, {k: tokens[k].numpy() for k in ("input_ids", "attention_mask")})[0]
    with torch.no_grad():
        reference = model(tokens["input_ids"], tokens["attention_mask"], "passage").numpy()
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    result = ExportResult(target, float(np.abs(ours - reference).max()), float(cosine.min()))
    if result.min_cosine < MIN_COSINE:
        raise ConfigError(f"the ONNX graph's embeddings differ from the model's (cosine {result.min_cosine:.6f})")
    return result


def check_repo_id(repo: str) -> None:
    """A one-line ConfigError, before the model loads, for what the Hub does not take as a repo id (``name`` or
    ``org/name``: letters, digits, ``-``, ``_``, ``.``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        first = (str(err).strip().splitlines() or ["not a repo id"])[0]
        raise ConfigError(f"--to hub takes a repo id, org/name: {repo!r} is not one ({first})") from None


def _to_hub(model_dir: Path, model, repo: str, private: bool) -> ExportResult:
    from huggingface_hub import HfApi

    from densepass.hub_snapshots import network_errors

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        folder.mkdir()
        _copy_model(model_dir, folder)
        atomic_write_text(folder / "README.md", model_card(model_dir, model))
        api = HfApi()
        try:
            api.create_repo(repo, private=private, exist_ok=True)
            # an existing repo keeps its visibility (create_repo ignores private=): never publish a private export
            if private and not api.repo_info(repo).private:
                raise ConfigError(
                    f"the Hugging Face Hub repo {repo} exists and is public: --private would upload into it; make it "
                    "private first, or export to another repo"
                )
            api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message="densepass export")
        except network_errors() as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(f"could not upload to the Hugging Face Hub repo {repo}: {first}") from None
    return ExportResult(f"https://huggingface.co/{repo}")


def _read_yaml(path: Path) -> dict:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
