"""Training checkpoints shared by fine-tuning and pre-training: atomic, verified, resumed bit for bit.

A checkpoint is a directory ``checkpoints/step-N/`` written atomically (a temporary directory renamed
into place) holding

- the model, written by the trainer (``BiEncoder.save`` or safetensors weights);
- ``state.safetensors`` + ``state.json``: optimizer, learning-rate scheduler, step, the random states of
  torch (CPU and CUDA), NumPy and Python, the trainer's extras, and the *identity* of the run (the
  settings that change what is trained) -- as plain tensors and JSON, so resuming never unpickles;
- ``manifest.json``, written last: the size and BLAKE2b digest of every other file.

``Checkpoints.latest`` verifies the newest checkpoint against its manifest and falls back to the
next newest intact one with a warning, so a checkpoint damaged on disk costs only the steps since the
one before it. Restoring the random states makes a resumed run continue exactly as the uninterrupted
run would have: same batches, same dropout, same final weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from densepass import distributed
from densepass.device import resolved_cpu_bf16
from densepass.errors import ConfigError, DataWarning, DensepassError
from densepass.io import (
    atomic_directory,
    atomic_write_text,
    disk_errors,
    foreign_files,
    hold_temporaries,
    manifest_problem,
    remove_stale_temporaries,
    write_manifest,
)

# training settings that change how often things are written or how batches are tokenised, not what is
# trained: a resumed run may change them
BOOKKEEPING = ("checkpoint_every", "keep_checkpoints", "log_every", "token_cache")
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"


def teacher_training_identity(settings: dict) -> dict:
    """A distilling run's record of how its teacher (the run's own reranker) trains: ``settings`` without the
    ``BOOKKEEPING`` keys, which change what is written, not the teacher (runs written before this left them in:
    ``Checkpoints`` drops them from those too, so changing them never refuses a resume)."""
    return {k: v for k, v in settings.items() if k not in BOOKKEEPING}


def training_identity(config: Any, packing: bool | None = None) -> dict:
    """The settings of a training config dataclass that change what is trained (every field but the
    ``BOOKKEEPING`` ones, with ``cpu_bf16: auto`` resolved for this CPU, and ``packing: auto`` as ``packing``, the
    caller's resolution of it for its model and device: ``device.resolved_packing``): resuming across a change is
    refused."""
    identity = {k: v for k, v in dataclasses.asdict(config).items() if k not in BOOKKEEPING}
    if identity.get("packing") == "auto":
        if packing is None:
            raise ValueError("training_identity: packing: auto needs the packing it resolved to")
        identity["packing"] = bool(packing)
    if "cpu_bf16" in identity:
        identity["cpu_bf16"] = resolved_cpu_bf16(identity["cpu_bf16"])
    return without_later_defaults(identity)


# training options added after runs were already being written, with the value every earlier run trained
# with: at that value they stay out of a run's identity, so those runs still resume
LATER_OPTIONS = {
    "skip_nonfinite": False,
    "max_grad_norm": 1.0,
    "gradient_checkpointing": False,
    "lora_rank": 0,
    "lora_alpha": 16.0,
    "lora_dropout": 0.0,
    "lora_targets": None,
    "fsdp": False,
    "query_prompt": "",
    "passage_prompt": "",
    "matryoshka_dims": None,
    "matryoshka_weights": None,
    "matryoshka_init": "none",
    "packing": False,
    "l2sp": None,
    "l2sp_scope": "encoder",
    "relative_margin": 0.95,  # negatives
    "relative_teacher": "cross-encoder",
    "filter_precision": "fp32",
    "relative_activation": "sigmoid",
}


def without_later_defaults(identity: dict) -> dict:
    """``identity`` without the ``LATER_OPTIONS`` at their earlier value (``skip_nonfinite: true`` skips batches,
    another ``max_grad_norm`` clips otherwise: those are kept, and resuming an earlier run across them is refused)."""
    for key, value in LATER_OPTIONS.items():
        # the type too: a bool is never taken for a number
        if key in identity and identity[key] == value and type(identity[key]) is type(value):
            identity.pop(key)
    return identity


# ---- a tree of tensors and JSON values, stored without pickle ----------------------------------


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, tensors moved into ``tensors`` and referenced by key."""
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return np.asarray(value["__ndarray__"], dtype=value["dtype"])
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def save_tree(tree: dict, directory: Path) -> None:
    """Write a nested structure of dicts, lists, tuples, numbers, strings, tensors and arrays."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors)
    save_file(tensors, str(directory / STATE_TENSORS))
    atomic_write_text(directory / STATE_JSON, json.dumps(encoded))


def load_tree(directory: Path) -> dict:
    """Read back what ``save_tree`` wrote (JSON and safetensors only)."""
    tensors = load_file(str(directory / STATE_TENSORS))
    return _decode(json.loads((directory / STATE_JSON).read_text()), tensors)


# ---- random states ---------------------------------------------------------------------------


def capture_rng() -> dict:
    """The random states of Python, NumPy's global generator, torch's CPU generator and every CUDA device."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }


def restore_rng(state: dict) -> None:
    """Set the random states captured by ``capture_rng``."""
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for i, cuda in enumerate(state["cuda"][: torch.cuda.device_count() if torch.cuda.is_available() else 0]):
        torch.cuda.set_rng_state(cuda, i)


def _as_python_state(value: Any) -> tuple:
    """``random.setstate`` wants tuples all the way down."""
    return tuple(_as_python_state(v) if isinstance(v, (list, tuple)) else v for v in value)


# ---- checkpoint directories ------------------------------------------------------------------


def step_of(path: Path) -> int:
    """N of a ``step-N`` checkpoint directory."""
    return int(path.name.split("-", 1)[1])


@dataclass
class Resumed:
    """What a trainer needs to continue from a checkpoint."""

    path: Path
    step: int
    optimizer: dict
    scheduler: dict
    rng: dict
    extra: dict
    rngs: list[dict] | None = None  # every process's random states, in rank order (a run of several processes)

    def rng_of(self, rank: int, world_size: int) -> dict:
        """The random states process ``rank`` of ``world_size`` resumes with: its own where the run was written
        by as many processes (each drew its dropout masks from its own generator), else the writer's, with a
        warning (the run goes on, not bit-exactly)."""
        if self.rngs is not None and len(self.rngs) == world_size:
            return self.rngs[rank]
        if world_size > 1 or self.rngs is not None:
            written = len(self.rngs) if self.rngs is not None else "one process (or an older densepass)"
            warnings.warn(
                f"{self.path} was written by {written} and resumes in {world_size}: each process starts from the"
                " first one's random states, so the run does not resume bit-exactly",
                DataWarning,
                stacklevel=2,
            )
        return self.rng


class Checkpoints:
    """The ``checkpoints/`` folder of a run: save, keep the newest ``keep``, resume from the newest intact one.

    ``identity`` is what the run is (the settings that change training: data, model, loss, optimiser,
    batches); resuming a checkpoint whose identity differs is a ``ConfigError`` naming the differences,
    never a silent continuation of another run.
    """

    def __init__(self, run_dir: Path, keep: int, identity: dict) -> None:
        if keep < 1:
            raise ConfigError(f"keep_checkpoints must be >= 1, got {keep}")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.identity = json.loads(json.dumps(identity))  # as it will read back from JSON

    def paths(self) -> list[Path]:
        """Checkpoint directories by step, oldest first (verified or not)."""
        found = [p for p in self.root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
        return sorted(found, key=step_of)

    def save(
        self,
        step: int,
        write_model: Callable[[Path], None],
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        extra: dict | None = None,
        write_shards: Callable[[Path], dict] | None = None,
        rngs: list[dict] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically: ``write_model(directory)`` first, then state and manifest. A full
        disk is a one-line error (``io.disk_errors``), the partial checkpoint removed; the run resumes from the
        one before.

        ``write_shards(directory)``: what every process writes into the checkpoint being written (FSDP's shards,
        ``training.sharding``; collective). With it every process calls ``save``: rank 0 makes the directory, every
        process writes its shards into it, then rank 0 writes the rest and the manifest (of every process's files)
        and renames it into place; the state file's optimiser state is what ``write_shards`` returns.

        ``rngs``: every process's random states (``capture_rng``, gathered in rank order), for a run of several
        processes; the writer's alone are saved either way."""
        path = self.root / f"step-{step}"
        if write_shards is not None and distributed.rank() != 0:
            tmp = distributed.broadcast_object(None)  # rank 0's temporary directory
            if tmp is None:
                raise DensepassError(f"rank 0 could not start writing {path}")  # rank 0 raises the cause
            write_shards(Path(tmp))
            return path
        with disk_errors(path), hold_temporaries() as hold, contextlib.ExitStack() as stack:
            try:
                tmp = stack.enter_context(atomic_directory(path))
            except BaseException:
                if write_shards is not None:
                    distributed.broadcast_object(None)
                raise
            hold(tmp)
            if write_shards is not None:
                distributed.broadcast_object(str(tmp))
                optimizer_state = write_shards(tmp)
            else:
                optimizer_state = optimizer.state_dict()
            write_model(tmp)
            save_tree(
                {
                    "step": step,
                    "optimizer": optimizer_state,
                    "scheduler": scheduler.state_dict(),
                    "rng": capture_rng(),
                    **({"rngs": rngs} if rngs is not None else {}),
                    "extra": extra or {},
                    "identity": self.identity,
                },
                tmp,
            )
            write_manifest(tmp)
        # Prune among the checkpoints older than this one: never the one just written, nor a newer one (left by a
        # run resumed from an earlier checkpoint because the newer one was damaged; it is replaced when the run
        # gets there again). Pruning by position alone deleted the checkpoint just written and kept the damaged one.
        older = [p for p in self.paths() if step_of(p) < step]
        for old in older[: max(len(older) - (self.keep - 1), 0)]:
            foreign = foreign_files(old)
            if foreign:  # a file of the user's put into an old checkpoint: the checkpoint is kept, not deleted
                warnings.warn(
                    f"{old} is kept: it holds files densepass did not write ({', '.join(foreign[:3])})",
                    DataWarning,
                    stacklevel=2,
                )
                continue
            shutil.rmtree(old, ignore_errors=True)
        return path

    def latest(self) -> Resumed | None:
        """The newest checkpoint that verifies (None for a fresh run); damaged ones are skipped with a warning.
        Called at the start of training, which holds the run directory's lock: the partial checkpoints of a killed
        process (``.step-N.<random>.tmp``) are removed first (rank 0's; ``io.remove_stale_temporaries``)."""
        if distributed.rank() == 0:
            remove_stale_temporaries(self.root, r"step-\d+", owned=True)
        for path in reversed(self.paths()):
            problem = manifest_problem(path)
            if problem is None:
                try:
                    tree = load_tree(path)
                    resumed = Resumed(
                        path,
                        int(tree["step"]),
                        tree["optimizer"],
                        tree["scheduler"],
                        tree["rng"],
                        tree["extra"],
                        tree.get("rngs"),
                    )
                    identity = tree["identity"]
                # files of another format under a manifest that matches them (rewritten by hand): not a checkpoint
                except (OSError, ValueError, KeyError, TypeError, IndexError, SafetensorError) as err:
                    problem = f"its state does not load ({err})"
            if problem is not None:
                warnings.warn(
                    f"checkpoint {path} is damaged ({problem}); resuming from an earlier one", DataWarning, stacklevel=2
                )
                continue
            self._check_identity(path, identity)
            return resumed
        return None

    def _check_identity(self, path: Path, saved: dict) -> None:
        for key in RECORDED_LATER:  # written before it was recorded: taken as this run's
            if key in self.identity and key not in saved:
                saved = {**saved, key: self.identity[key]}
        teacher = saved.get("distill", {}).get("teacher") if isinstance(saved.get("distill"), dict) else None
        if isinstance(teacher, dict) and isinstance(teacher.get("train"), dict):  # written with its bookkeeping
            teacher = {**teacher, "train": teacher_training_identity(teacher["train"])}
            saved = {**saved, "distill": {**saved["distill"], "teacher": teacher}}
        if saved == self.identity:
            return
        data = data_change(saved, self.identity, path.name)
        if data is not None:
            raise _other_data(self.root.parent, data)
        raise ConfigError(
            f"{self.root.parent} holds a run with other settings ({differences(saved, self.identity)} differ "
            f"from {path.name}); {packing_hint(saved, self.identity)}"
            "use another name or output_dir, or --restart to discard it and start over"
        )


def packing_hint(saved: dict, current: dict) -> str:
    """The setting that resumes a run whose steps were packed otherwise than the current settings resolve them
    (``packing: auto`` on another device, or a run written padded before ``auto`` was the default), where that is a
    difference between the identities ``saved`` and ``current``."""
    for key in _differences(saved, current):
        section, _, name = key.rpartition(".")
        if name == "packing" and section in saved:
            was = bool(saved[section].get("packing", False))  # left out of an identity: false (LATER_OPTIONS)
            setting = SECTION_SETTINGS.get(section, section)
            return f"a run written {'packed' if was else 'padded'} resumes with {setting}.packing: {str(was).lower()}; "
    return ""


# identity sections added after runs were made, taken as the resuming run's where a checkpoint has none
RECORDED_LATER = ("model_source", "validation", "objective")
SECTION_SETTINGS = {"reranker": "reranker.train"}  # identity sections named otherwise than their config section


DATA_FILES = "data_files"  # the identity's {file: content digest} of the data a run reads


def data_change(saved: dict, current: dict, checkpoint: str) -> str | None:
    """How the data files of identity ``current`` differ from those of ``saved`` (the identity of checkpoint
    ``checkpoint``, e.g. ``step-5``), when nothing else differs; None otherwise."""
    if DATA_FILES not in current or {k: v for k, v in saved.items() if k != DATA_FILES} != {
        k: v for k, v in current.items() if k != DATA_FILES
    }:
        return None
    if saved.get(DATA_FILES) == current[DATA_FILES]:
        return None
    if DATA_FILES not in saved:
        return f"its checkpoint {checkpoint} does not record what its data files held (an older densepass wrote it)"
    old, new = saved[DATA_FILES], current[DATA_FILES]
    changes = [f"{name} changed" for name in new if name in old and old[name] != new[name]]
    changes += [f"{name} is new" for name in new if name not in old]
    changes += [f"{name} is no longer read" for name in old if name not in new]
    listed = ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
    return f"{listed} since its checkpoint {checkpoint} was written"


def _other_data(run_dir: Path, change: str) -> ConfigError:
    return ConfigError(
        f"{run_dir} holds a run that cannot resume on this data: {change}; use --restart to discard it and train "
        "on the data as it is now, or another name or output_dir"
    )


def check_data_files(run_dir: Path, data_files: dict[str, str]) -> None:
    """Refuse ``run_dir`` when its newest checkpoint was trained on other data files than ``data_files``
    (``RetrievalDataset.file_fingerprints``), before any work: for runs whose finished stages are skipped, and
    so never reach a resume. Only the checkpoint's state.json is read (a damaged one is left to the resume)."""
    for path in reversed(Checkpoints(run_dir, 1, {}).paths()):
        try:
            saved = json.loads((path / STATE_JSON).read_text())["identity"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        saved = {DATA_FILES: saved[DATA_FILES]} if isinstance(saved, dict) and DATA_FILES in saved else {}
        change = data_change(saved, {DATA_FILES: data_files}, path.name)
        if change is not None:
            raise _other_data(Path(run_dir), change)
        return


def differences(a: Any, b: Any) -> str:
    """The dotted keys whose values differ between two JSON trees, the first six named ("" when none)."""
    changed = sorted(_differences(a, b))
    return ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON trees."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def trim_log(path: Path, step: int) -> None:
    """Drop the records of a JSONL log written after ``step`` (steps that are being trained again), and the lines
    that are no record: cut short by an interruption, or damaged bytes that are not even UTF-8 (as ``plots.read_log``
    leaves them out of the plots). A link there is refused: densepass never writes through one (it would copy the
    target's records into the run, or, dangling, write the log outside it)."""
    if path.is_symlink():
        raise DensepassError(f"{path} is a link: densepass writes its logs only as files of its own; remove it")
    if not path.is_file():
        return
    kept = []
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            if line.strip() and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            continue  # a record cut short by the interruption, or damaged
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))
