"""Fuzzing harness (issue 49): whatever a user writes into a config or a dataset, densepass either accepts it or
refuses it with one line, ``densepass: error: ...`` (a :class:`DensepassError` whose text is a single line,
exit code 2), never a traceback.

1. Configs: every key of ``ExperimentConfig``, ``PretrainConfig`` and ``PhraseConfig`` (the dataclasses walked
   recursively) set to random values of every type (huge and negative integers, NaN / inf / 1e308, empty,
   unicode and path-like strings, lists, mappings, null, booleans), both as a parsed mapping (``from_dict``, what
   a YAML or JSON file gives) and as ``--set KEY=TEXT`` overrides (``load_config`` / ``apply_overrides``, what
   ``densepass run --set`` does), then the checks each command runs before any work (``check`` of
   ``pipelines.experiment``, ``pretraining.trainer`` and ``phrase.experiment``). A few examples go through the real
   CLI: ``densepass run`` on a tiny dataset (with a model folder that holds none, so that nothing trains) and
   ``densepass config``, whose printed YAML must load back to the same config.
2. Dataset files: random corpus, queries and qrels lines (JSON of random shapes, invalid JSON, random bytes,
   non-UTF-8, NUL, lone surrogates, huge or blank ids, repeated ids; TSV qrels with wrong columns and odd grades)
   in a tiny BEIR folder (and an MS MARCO one), read with ``load_dataset``: a dataset whose qrels name only
   queries and passages it has, or one line.
3. Every id a loaded dataset holds is non-empty text without whitespace or lone surrogates: what
   ``test_bad_inputs.py::test_any_id_the_readers_accept_round_trips_through_trec_run_and_qrels_files`` shows
   round-trips through ``write_trec_run`` -> ``read_trec_run``.

What the harness found is kept as plain examples at the end of each part. Hypothesis is derandomized (the same
examples on every run, so a CI failure replays) and bounded so that the file runs in about 30 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types
import typing
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densepass.config import ExperimentConfig, explain, from_dict, load_config
from densepass.errors import DensepassError
from densepass.phrase.config import PhraseConfig
from densepass.pretraining.config import PretrainConfig

# Reproducible in CI: the same examples every run, no example database, no deadline (a first call imports).
FUZZ = dict(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))


def assert_one_line(err: BaseException) -> None:
    """``err`` is a densepass error whose message is one non-empty line (what the CLI prints after 'error: ')."""
    assert isinstance(err, DensepassError), f"{type(err).__name__} escaped: {err!r}"
    text = str(err)
    assert text.strip(), f"empty message from {type(err).__name__}"
    assert "\n" not in text and "\r" not in text, f"message of more than one line: {text!r}"


@contextmanager
def accepted_or_one_line():
    """The block either runs through, or raises a one-line DensepassError (anything else fails the test)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except DensepassError as err:
        assert_one_line(err)
    # any other exception propagates: hypothesis reports it with the example that raised it


# ---------------------------------------------------------------------------------------------------- config


def leaves(cls: type, prefix: str = "") -> list[tuple[str, Any, typing.Mapping[str, Any]]]:
    """``(dotted key, annotation, metadata)`` of every field of ``cls`` and of its sections, recursively; the
    sections themselves are listed too (a section given a scalar is a bad input as well)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append((f"{prefix}{f.name}", hints[f.name], f.metadata))
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(leaves(hints[f.name], f"{prefix}{f.name}."))
    return out


CONFIGS = {"run": ExperimentConfig, "pretrain": PretrainConfig, "phrase": PhraseConfig}
KEYS = {name: leaves(cls) for name, cls in CONFIGS.items()}


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_the_walk_finds_every_key(which):
    """The keys fuzzed are every key ``densepass config --explain`` lists, and the sections (a list of sections'
    entry keys, ``data.mix[].name``, are fuzzed with the list: no override path names them)."""
    fuzzed = {key for key, _, _ in KEYS[which]}
    assert fuzzed >= {key for key, *_ in explain(CONFIGS[which]) if "[]." not in key}
    assert {"data", "model", "train"} <= fuzzed


HUGE_INTS = [2**31, 2**32, 2**32 - 1, 2**53 + 1, 2**63, 2**64, 10**30, -(2**63), -1, 0, 1]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 1.7976931348623157e308, 5e-324, -0.0, 0.0, 0.5, 1.0, 1e-9]
ODD_STRINGS = [
    "",
    " ",
    "\t",
    "\n",
    "\x00",
    "a\x00b",
    "\ud800",
    "../x",
    "..",
    ".",
    "/",
    "/dev/null",
    "~",
    "a/b",
    "C:\\x",
    "nan",
    "inf",
    "-inf",
    "1e999",
    "1e-5",
    "0x10",
    "true",
    "null",
    "cuda",
    "cuda:99",
    "cuda:-1",
    "cpu:1",
    "cpu:0",
    "cpu:99999999999999999999999",
    "mps",
    "meta",
    "mrr@0",
    "mrr@",
    "accuracy@1",
    "recall@99999999999999999999",
    "ünïcödé ✓ 検索",
    "\u202e\u2028",
]


def long(make) -> st.SearchStrategy:
    """A value too long to show in a report (hypothesis prints the strategy, not the value)."""
    return st.builds(make)


long_strings = st.one_of(long(lambda: "mrr@" + "9" * 5000), long(lambda: "x" * 5000), long(lambda: "1" * 5000))
huge_ints = st.one_of(
    st.sampled_from(HUGE_INTS), long(lambda: 10**400), long(lambda: -(10**400)), long(lambda: 10**5000)
)  # 10**5000: more digits than Python parses or prints

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(ODD_FLOATS),
    st.text(max_size=20),
    st.sampled_from(ODD_STRINGS),
    long_strings,
)
wild = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=3)
    ),
    max_leaves=8,
)


def near_valid(annotation: Any, meta: typing.Mapping[str, Any]) -> st.SearchStrategy:
    """Values of about the right type for a field: its range's edges and just past them, its Literal's values,
    lists of those; the places where a type check or a range check is most likely to slip."""
    origin, args = get_origin(annotation), get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(annotation)]), wild, max_size=3)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(near_valid(a, meta) for a in args if a is not type(None)), st.none())
    if origin is list:
        return st.lists(near_valid(args[0], meta), max_size=4)
    if annotation is bool:
        return st.booleans()
    edges = [meta.get(k) for k in ("min", "max", "above") if meta.get(k) is not None]
    if annotation is int:
        around = [int(e) + d for e in edges for d in (-1, 0, 1)]
        return st.one_of(st.sampled_from(around or [0]), st.integers(-5, 5), huge_ints)
    if annotation is float:
        around = [e + d for e in edges for d in (-1e-12, 0.0, 1e-12, -1.0, 1.0)]
        return st.one_of(st.sampled_from(around or [0.0]), st.floats(-2, 2), st.sampled_from(ODD_FLOATS), huge_ints)
    return st.one_of(st.text(max_size=20), st.sampled_from(ODD_STRINGS), long_strings)


@st.composite
def settings_of(draw, which: str) -> list[tuple[str, Any]]:
    """1-4 (key, value) pairs of config ``which``: a random field, a value of any type or one near its type."""
    pairs = []
    for _ in range(draw(st.integers(1, 4))):
        key, annotation, meta = draw(st.sampled_from(KEYS[which]))
        pairs.append((key, draw(st.one_of(wild, near_valid(annotation, meta), near_valid(annotation, meta)))))
    return pairs


def nested(pairs: list[tuple[str, Any]]) -> dict:
    """The mapping a YAML file holding ``pairs`` would parse to (a later key under an earlier scalar replaces it)."""
    values: dict = {}
    for key, value in pairs:
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return values


@contextmanager
def unlimited_ints():
    """Python writes integers of any length in the block (10**5000 in a file: reading it is the code's problem)."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if limit:
        sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        if limit:
            sys.set_int_max_str_digits(limit)


def as_yaml_text(value: Any) -> str:
    """``value`` written as ``--set`` takes it: YAML flow text (JSON for what YAML cannot write)."""
    with unlimited_ints():
        try:
            return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()
        except (yaml.YAMLError, UnicodeEncodeError):
            return json.dumps(value)


def run_checks(which: str, config: Any) -> None:
    """The checks command ``which`` runs on a loaded config before any work."""
    if which == "run":
        from densepass.pipelines.experiment import check

        check(config)
    elif which == "pretrain":
        from densepass.pretraining.trainer import check

        check(config)
    else:
        from densepass.phrase.experiment import check

        check(config)


@pytest.mark.parametrize("which", sorted(CONFIGS))
@settings(max_examples=250, **FUZZ)
@given(data=st.data())
def test_any_config_mapping_loads_or_is_a_one_line_error(which, data):
    """A config file's parsed mapping (YAML or JSON) with random values at random keys."""
    pairs = data.draw(settings_of(which))
    with accepted_or_one_line():
        run_checks(which, from_dict(CONFIGS[which], nested(pairs)))


@pytest.mark.parametrize("which", sorted(CONFIGS))
@settings(max_examples=250, **FUZZ)
@given(data=st.data())
def test_any_set_override_loads_or_is_a_one_line_error(which, data):
    """``--set KEY=TEXT`` as ``densepass run/pretrain/phrase`` builds the config: TEXT is the value written as YAML
    or random text; KEY a field or random text."""
    pairs = data.draw(settings_of(which))
    overrides = [f"{key}={as_yaml_text(value)}" for key, value in pairs]
    raw = st.one_of(st.text(max_size=30), st.sampled_from(ODD_STRINGS))
    overrides += data.draw(st.lists(st.one_of(raw, raw.map(lambda text: f"{pairs[0][0]}={text}")), max_size=2))
    with accepted_or_one_line():
        run_checks(which, load_config(None, overrides, CONFIGS[which]))


@settings(max_examples=150, **FUZZ)
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_any_config_file_text_loads_or_is_a_one_line_error(tmp_path, suffix, text):
    path = tmp_path / f"config{suffix}"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    with accepted_or_one_line():
        run_checks("run", load_config(path))


# What the harness found (each was a traceback before its fix), kept as plain examples so that they run on every
# version of hypothesis, whatever examples it draws.
FOUND = [
    ("run", ["reranker.train.head_learning_rate=1" + "0" * 400]),  # OverflowError: int too large to convert to float
    ("run", [f"train.epochs={2**64}"]),  # accepted, then an OverflowError in NumPy
    ("run", ["data={[1, 2]: 3}"]),  # TypeError: unhashable type: 'list' (the repeated-key check)
    ("run", ["data.name=*x"]),  # PyYAML's message: four lines, with a snippet and a caret
    ("run", ["device=a\x00b"]),  # PyYAML's ReaderError: two lines
    (
        "run",
        ["train.epochs=" + "1" * 5000],
    ),  # ValueError: Exceeds the limit (4300 digits) for integer string conversion
    ("run", ["data.name=2001-02-30"]),  # ValueError: day is out of range for month
    ("run", ["data.name=!!bool x"]),  # KeyError: 'x'
    ("run", ["data.name=!!timestamp x"]),  # AttributeError: 'NoneType' object has no attribute 'groupdict'
    ("run", ["data.name=" + "[" * 5000 + "]" * 5000]),  # RecursionError
    ("run", ['output_dir="\\x00"']),  # accepted, then ValueError: embedded null byte where the run directory is made
    ("run", ['name="\\ud800"']),  # accepted, then UnicodeEncodeError where the run directory is made
    ("run", ["eval.metrics=[mrr@" + "9" * 5000 + "]"]),  # ValueError in check_metrics (int of 5000 digits)
    ("run", [f"eval.metrics=[mrr@{2**63}]"]),  # accepted, then OverflowError in ranx
    ("run", ["reranker.enabled=true", "reranker.name_or_path=" + "x" * 300]),  # OSError: File name too long
    ("phrase", ["eval.ks=[0]"]),  # accepted: a list's items were not range-checked
]


@pytest.mark.parametrize("which, overrides", FOUND, ids=lambda x: x if isinstance(x, str) else repr(x)[:40])
def test_what_the_harness_found_is_a_one_line_error(which, overrides):
    with pytest.raises(DensepassError) as caught:
        run_checks(which, load_config(None, overrides, CONFIGS[which]))
    assert_one_line(caught.value)


@pytest.mark.parametrize(
    "text", ["[" * 5000 + "]" * 5000, '{"train": {"epochs": 1' + "0" * 5000 + "}}"], ids=["deep", "5001-digits"]
)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_files_beyond_pythons_limits_are_a_one_line_error(tmp_path, text, suffix):
    path = tmp_path / f"config{suffix}"
    path.write_text(text)
    with pytest.raises(DensepassError) as caught:
        load_config(path)
    assert_one_line(caught.value)


# ---- the same through the command line: exit 0 with valid output, or exit 2 and one line

E2E_SKIPPED = {"output_dir"}  # kept inside the test's folder: the fuzzed runs write nowhere else


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A folder with the tiny BEIR dataset and a folder that is not a model (the runs stop where they load it)."""
    from conftest import write_tiny_beir

    root = tmp_path_factory.mktemp("fuzz-cli")
    write_tiny_beir(root / "tiny")
    (root / "not-a-model").mkdir()
    return root


@contextmanager
def inside(directory: Path):
    """Run the block with ``directory`` as the working directory (relative paths a fuzzed key names land there)."""
    previous = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)


def cli(args: list[str], capsys) -> tuple[int, str, list[str]]:
    """``densepass ARGS`` in this process: exit code, stdout, and stderr's lines that are not warnings."""
    from densepass.cli import main

    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, [line for line in err.splitlines() if not line.startswith("densepass: warning: ")]


def assert_exit_0_or_one_error_line(code: int, errors: list[str]) -> None:
    assert code in (0, 2), f"exit code {code}"
    if code == 2:
        assert len(errors) == 1 and errors[0].startswith("densepass: error: "), errors
    else:
        assert not [line for line in errors if line.startswith("densepass: error")], errors


RUNS = iter(range(10**6))


@settings(max_examples=30, **FUZZ)
@given(pairs=settings_of("run"))
def test_densepass_run_with_random_settings_exits_0_or_2_with_one_line(sandbox, capsys, pairs):
    """``densepass run --set ...`` on the tiny dataset; the model is a folder without one, so that a run whose
    settings pass every check stops where it loads it (one line, exit 2) instead of training."""
    n = next(RUNS)
    overrides = [f"data.name={sandbox / 'tiny'}", "eval.metrics=[mrr@10]", "eval.baselines=[]"]
    overrides += [f"{key}={as_yaml_text(value)}" for key, value in pairs if key not in E2E_SKIPPED]
    overrides += [f"output_dir={sandbox / f'runs-{n}'}", f"model.name_or_path={sandbox / 'not-a-model'}"]
    with inside(sandbox):
        code, _, errors = cli(["run", *(a for o in overrides for a in ("--set", o))], capsys)
    assert_exit_0_or_one_error_line(code, errors)
    assert code == 2  # nothing trains without a model


@pytest.mark.parametrize("which", sorted(CONFIGS))
@settings(max_examples=20, **FUZZ)
@given(data=st.data())
def test_densepass_config_with_random_settings_prints_a_config_that_loads_or_one_line(sandbox, capsys, which, data):
    """``densepass config [--pretrain | --phrase] --set ...``: exit 0 with a YAML config on stdout that loads
    back to the same config, or exit 2 with one line."""
    pairs = data.draw(settings_of(which))
    overrides = [f"{key}={as_yaml_text(value)}" for key, value in pairs]
    flag = {"run": [], "pretrain": ["--pretrain"], "phrase": ["--phrase"]}[which]
    with inside(sandbox):
        code, out, errors = cli(["config", *flag, *(a for o in overrides for a in ("--set", o))], capsys)
    assert_exit_0_or_one_error_line(code, errors)
    if code == 0:
        printed = sandbox / f"printed-{which}.yaml"
        printed.write_text(out, encoding="utf-8")
        assert load_config(printed, cls=CONFIGS[which]) == load_config(None, overrides, CONFIGS[which])


# ------------------------------------------------------------------------------------------------- dataset files

ID_POOL = ["p0", "p1", "p2", "q0", "q1", "q2", "d0"]  # ids that repeat: duplicates, and qrels that match
ODD_IDS = ["", " ", "\t", "p0 ", " p0", "a b", "a\tb", "a\nb", "\x00", "\u00a0", "\u200b", "\ud800", "ü", "检索", "-1"]

ids = st.one_of(
    st.sampled_from(ID_POOL),
    st.sampled_from(ODD_IDS),
    st.text(max_size=6),
    st.integers(),
    huge_ints,
    st.floats(allow_nan=False),
    st.none(),
    st.booleans(),
    st.lists(st.sampled_from(ID_POOL), max_size=2),
)
texts = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "\u200b", "\x00", "\ud800", "a b c"]), long_strings)
field_values = st.one_of(texts, wild)
json_values = st.one_of(field_values, ids)


def json_line(record: dict) -> bytes:
    """A JSON line (NaN written as Python does), non-ASCII characters as escapes or as UTF-8 (lone surrogates as
    their invalid UTF-8 bytes)."""
    with unlimited_ints():
        return json.dumps(record, ensure_ascii=len(record) % 2 == 0).encode("utf-8", "surrogatepass")


@st.composite
def records(draw, fields: dict[str, st.SearchStrategy]) -> dict:
    """A JSON object with each of ``fields`` present (drawn from its strategy) or missing, and maybe an extra key."""
    out = {key: draw(strategy) for key, strategy in fields.items() if draw(st.integers(0, 5))}
    if draw(st.booleans()):
        out[draw(st.text(max_size=6))] = draw(json_values)
    return out


def garbage_lines() -> st.SearchStrategy[bytes]:
    """Lines that are not a JSON object: invalid JSON, other JSON values, random and non-UTF-8 bytes, NUL, a lone
    surrogate escape, a huge or deeply nested number, blank lines."""
    return st.one_of(
        st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
        st.text(max_size=30).map(lambda t: t.replace("\n", " ").encode("utf-8", "surrogatepass")),
        st.sampled_from(
            [
                b"",
                b"   ",
                b"\x00",
                b"\xff\xfe",
                b"\xc3\x28",
                b"{",
                b"[]",
                b"null",
                b"1",
                b'"p0"',
                b'{"_id": "p0", "text": "a"',
                b'{"_id": "\\ud800", "text": "a"}',
                b'{"_id": "p9", "text": "\\udc80x"}',
                b'{"_id": "p9", "text": "a", "_id": "p8"}',
                b'{"_id": "p9", "text": 1e999}',
                b'{"_id": "p9", "text": NaN}',
                b'{"_id": 1.5, "text": "a"}',
                b'\xef\xbb\xbf{"_id": "p9", "text": "a"}',
            ]
        ),
        long(lambda: b'{"_id": 1' + b"0" * 5000 + b', "text": "a"}'),  # more digits than Python parses
        long(lambda: b'{"_id": "p9", "text": ' + b"[" * 5000 + b"]" * 5000 + b"}"),  # nested deeper than it recurses
        long(lambda: b'{"_id": "p9", "text": "' + b"x" * 200_000 + b'"}'),
    )


corpus_lines = st.one_of(
    records({"_id": ids, "text": texts, "title": field_values, "doc_id": ids}).map(json_line), garbage_lines()
)
query_lines = st.one_of(
    records({"_id": ids, "text": texts, "answers": wild, "metadata": wild}).map(json_line), garbage_lines()
)
grades = st.one_of(
    st.sampled_from(["1", "0", "2", "-1", "1.0", "0.5", "1e3", "1e999", "nan", "inf", "-inf", "x", "", " 1", "1_0"]),
    st.sampled_from([str(i) for i in HUGE_INTS if abs(i) < 10**40] + ["9" * 20]),
    long(lambda: "1" * 5000),
    st.integers().map(str),
    st.text(max_size=4),
)
qrels_columns = st.one_of(
    st.tuples(st.sampled_from(ID_POOL), st.sampled_from(ID_POOL), grades),  # what usually appears
    st.tuples(st.sampled_from(ID_POOL), st.just("0"), st.sampled_from(ID_POOL), grades),  # TREC
    st.lists(st.one_of(st.sampled_from(ID_POOL), st.sampled_from(ODD_IDS), grades), max_size=6).map(tuple),
)
qrels_lines = st.one_of(
    st.tuples(qrels_columns, st.sampled_from(["\t", " ", "  ", "\t "])).map(
        lambda c: c[1].join(c[0]).encode("utf-8", "surrogatepass")
    ),
    st.sampled_from([b"query-id\tcorpus-id\tscore", b'"q0\tp0\t1', b"q0\tp0\t1\x00", b"q0\x00\tp0\t1"]),
    long(lambda: b"q0\tp0\t" + b"1" * 200_000),  # a field over the csv module's limit
    garbage_lines(),
)

VALID_CORPUS = [json_line({"_id": f"p{i}", "title": "", "text": f"words of passage {i}"}) for i in range(3)]
VALID_QUERIES = [json_line({"_id": f"q{i}", "text": f"query {i}"}) for i in range(3)]
VALID_QRELS = [b"query-id\tcorpus-id\tscore", *(f"q{i}\tp{i}\t1".encode() for i in range(3))]


@st.composite
def mutated(draw, valid: list[bytes], lines: st.SearchStrategy[bytes]) -> list[bytes]:
    """``valid`` lines with some replaced, some inserted and some dropped; or random lines only."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.lists(lines, max_size=5))
    out = list(valid)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(out)))
        action = draw(st.sampled_from(["insert", "replace", "drop", "repeat"]))
        if action == "insert" or not out:
            out.insert(at, draw(lines))
        elif action == "replace":
            out[min(at, len(out) - 1)] = draw(lines)
        elif action == "drop":
            out.pop(min(at, len(out) - 1))
        else:
            out.insert(at, out[min(at, len(out) - 1)])
    return out


def write_lines(path: Path, lines: list[bytes], ending: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ending.join(lines) + (ending if lines else b""))


def assert_consistent(dataset) -> None:
    """What every loaded dataset holds: ids that are non-empty text without whitespace, unique passage ids, a
    passage text for each, and qrels naming only queries and passages that exist, with integer grades."""
    corpus = dataset.corpus
    assert len(corpus) > 0 and len(set(corpus.ids)) == len(corpus.ids)
    all_texts = list(corpus.texts)
    assert len(all_texts) == len(corpus) and all(isinstance(t, str) for t in all_texts)
    assert all(isinstance(t, str) for t in corpus.titles) and all(isinstance(d, str) and d for d in corpus.doc_ids)
    for pid in corpus.ids:
        assert isinstance(pid, str) and pid and not any(c.isspace() for c in pid), pid
        pid.encode("utf-8")  # no lone surrogate
    for qid, text in dataset.queries.items():
        assert isinstance(qid, str) and qid and not any(c.isspace() for c in qid), qid
        assert isinstance(text, str)
        (qid + text).encode("utf-8")
    for split, qrels in dataset.qrels.items():
        for qid, rels in qrels.items():
            assert qid in dataset.queries, (split, qid)
            for pid, grade in rels.items():
                assert pid in corpus, (split, qid, pid)
                assert isinstance(grade, int) and not isinstance(grade, bool) and abs(grade) < 2**31, grade
    for qid, found in dataset.answers.items():
        assert qid in dataset.queries and all(isinstance(a, str) for a in found)


FILES = {
    "corpus.jsonl": (VALID_CORPUS, corpus_lines),
    "queries.jsonl": (VALID_QUERIES, query_lines),
    "qrels/dev.tsv": (VALID_QRELS, qrels_lines),
}


@settings(max_examples=1500, **FUZZ)
@given(
    target=st.sampled_from([*FILES, "all"]),
    data=st.data(),
    ending=st.sampled_from([b"\n", b"\r\n", b"\n\n", b"\r"]),
    compress=st.sampled_from(["no"] * 8 + ["gzip", "truncated gzip"]),
    on_disk=st.booleans(),
)
def test_any_beir_files_load_consistently_or_are_a_one_line_error(target, data, ending, compress, on_disk):
    """One file of a tiny BEIR dataset mutated (lines replaced, inserted, dropped or repeated), or all three, read
    in memory or with its passages on disk: a consistent dataset or one line."""
    import gzip
    import tempfile

    from densepass.data import load_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "beir"
        for name, (valid, lines) in FILES.items():
            write_lines(
                root / name, data.draw(mutated(valid, lines), label=name) if target in (name, "all") else valid, ending
            )
        if compress != "no":  # the corpus gzipped, or gzipped and cut short
            packed = gzip.compress((root / "corpus.jsonl").read_bytes())
            (root / "corpus.jsonl.gz").write_bytes(packed if compress == "gzip" else packed[:-5])
            (root / "corpus.jsonl").unlink()
        with accepted_or_one_line():
            assert_consistent(load_dataset(str(root), format="beir", passages_on_disk=on_disk))


def tsv_line(columns: tuple[str, ...], separator: str) -> bytes:
    return separator.join(columns).encode("utf-8", "surrogatepass")


tsv_ids = st.one_of(st.sampled_from(ID_POOL), st.sampled_from(ODD_IDS), st.text(max_size=6), grades)
id_text_lines = st.one_of(
    st.tuples(st.tuples(tsv_ids, texts), st.sampled_from(["\t", " ", "\t\t"])).map(lambda c: tsv_line(*c)),
    st.sampled_from([b"id\ttext", b"pid\tpassage", b"qid\tquery", b"p0", b"\tx", b"p0\t"]),
    garbage_lines(),
)
MSMARCO = {
    "collection.tsv": ([f"p{i}\tpassage {i}".encode() for i in range(3)], id_text_lines),
    "queries.dev.tsv": ([f"q{i}\tquery {i}".encode() for i in range(3)], id_text_lines),
    "qrels.dev.tsv": ([f"q{i} 0 p{i} 1".encode() for i in range(3)], qrels_lines),
}


@settings(max_examples=500, **FUZZ)
@given(target=st.sampled_from([*MSMARCO, "all"]), data=st.data(), ending=st.sampled_from([b"\n", b"\r\n"]))
def test_any_msmarco_files_load_consistently_or_are_a_one_line_error(target, data, ending):
    """The same for the MS MARCO layout (``id<TAB>text`` lines and TREC qrels)."""
    import tempfile

    from densepass.data import load_dataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "msmarco"
        for name, (valid, lines) in MSMARCO.items():
            chosen = data.draw(mutated(valid, lines), label=name) if target in (name, "all") else valid
            write_lines(root / name, chosen, ending)
        with accepted_or_one_line():
            assert_consistent(load_dataset(str(root), format="msmarco"))


@pytest.mark.parametrize(
    "name, line",
    [
        ("corpus.jsonl", b'{"_id": 1' + b"0" * 5000 + b', "text": "a"}'),  # ValueError from json.loads
        ("queries.jsonl", b'{"_id": "q9", "text": ' + b"[" * 5000 + b"]" * 5000 + b"}"),  # RecursionError
        ("qrels/dev.tsv", b"q0\tp1\t" + b"1" * 200_000),  # csv.Error: field larger than field limit
        ("qrels/dev.tsv", b"q0\tp1\t9223372036854775808"),  # loaded; ranx overflowed evaluating it
    ],
    ids=["5001-digit-id", "deep-text", "long-field", "grade-2**63"],
)
def test_what_the_harness_found_in_dataset_files_is_a_one_line_error(tmp_path, name, line):
    from densepass.data import load_dataset

    for file, (valid, _) in FILES.items():
        write_lines(tmp_path / file, [*valid, line] if file == name else valid, b"\n")
    with pytest.raises(DensepassError) as caught:
        load_dataset(str(tmp_path), format="beir")
    assert_one_line(caught.value)
    with pytest.raises(DensepassError) as caught:  # a path too long to look up (OSError: File name too long)
        load_dataset("x" * 300 + "/y", format="beir")
    assert_one_line(caught.value)
