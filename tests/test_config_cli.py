"""Typed configuration (YAML/JSON, typos, types, overrides), the CLI's one-line errors, and the
evaluation subcorpus (gold + BM25 top-k + random passages)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from densepass.cli import main
from densepass.config import DataConfig, ExperimentConfig, load_config, save_config
from densepass.errors import ConfigError

# ---- load_config ------------------------------------------------------------------------------


def test_load_config_from_yaml(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        "name: tiny\n"
        "train:\n  batch_size: 3\n  learning_rate: 1.0e-4\n  max_steps: 7\n"
        "eval:\n  index: faiss-hnsw\n  metrics: [mrr@10, recall@5]\n"
        "model:\n  projection_dim: 16\n  pooling: cls\n"
    )
    config = load_config(path)
    assert isinstance(config, ExperimentConfig)
    assert config.name == "tiny"
    assert config.train.batch_size == 3 and config.train.max_steps == 7
    assert config.train.learning_rate == pytest.approx(1e-4)
    assert config.eval.index == "faiss-hnsw" and config.eval.metrics == ["mrr@10", "recall@5"]
    assert config.model.projection_dim == 16 and config.model.pooling == "cls"
    # everything not mentioned keeps its default
    assert config.data == DataConfig()
    assert config.train.epochs == ExperimentConfig().train.epochs


def test_load_config_from_json(tmp_path):
    path = tmp_path / "exp.json"
    path.write_text(
        json.dumps({"name": "j", "data": {"name": "scifact", "max_eval_queries": None}, "train": {"epochs": 2}})
    )
    config = load_config(path)
    assert (config.name, config.data.name, config.data.max_eval_queries, config.train.epochs) == (
        "j",
        "scifact",
        None,
        2,
    )


def test_int_is_accepted_for_float_field(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  learning_rate: 1\n")
    value = load_config(path).train.learning_rate
    assert value == 1.0 and isinstance(value, float)


def test_exponent_without_dot_is_a_float(tmp_path):
    """YAML 1.1 parses `5e-5` as a string; a learning rate written that way must still work."""
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  learning_rate: 5e-5\n")
    assert load_config(path).train.learning_rate == 5e-5
    assert load_config(None, ["train.learning_rate=3e-4"]).train.learning_rate == 3e-4
    with pytest.raises(ConfigError, match=r"learning_rate: expected a number, got 'fast'"):
        load_config(None, ["train.learning_rate=fast"])


def test_empty_file_and_none_give_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == ExperimentConfig()
    assert load_config(None) == ExperimentConfig()


@pytest.mark.parametrize("top", ["[]", "0", "false", "''", "[1]", "x"])
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_top_level_that_is_not_a_mapping_is_refused_even_when_empty_or_false(tmp_path, top, suffix):
    """An empty list, 0 or false used to be taken for an empty file (every default: a long run started)."""
    path = tmp_path / f"exp{suffix}"
    path.write_text(top if suffix == ".yaml" else {"''": '""', "x": '"x"'}.get(top, top))
    with pytest.raises(ConfigError, match=r"the top level must be a mapping, got (list|int|bool|str)$"):
        load_config(path)


def test_unknown_key_suggests_close_name(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  batch_szie: 3\n")
    with pytest.raises(ConfigError, match=r"config\.train: unknown key 'batch_szie' \(did you mean 'batch_size'\?\)"):
        load_config(path)


def test_unknown_key_without_close_name_lists_known_keys(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("zzzzzz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'zzzzzz' \(known: .*\btrain\b"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  batch_size: eight\n", r"config\.train\.batch_size: expected an integer, got 'eight'"),
        ("train:\n  batch_size: 8.5\n", r"config\.train\.batch_size: expected an integer"),
        ("train:\n  batch_size: true\n", r"config\.train\.batch_size: expected an integer"),
        ("train:\n  max_steps: many\n", r"config\.train\.max_steps: expected an integer"),
        ("eval:\n  index: annoy\n", r"config\.eval\.index: 'annoy' is not one of 'exact', 'faiss-flat'"),
        ("model:\n  pooling: max\n", r"config\.model\.pooling: 'max' is not one of"),
        ("model:\n  normalize: 'yes'\n", r"config\.model\.normalize: expected true/false"),
        ("eval:\n  metrics: mrr@10\n", r"config\.eval\.metrics: expected a list"),
        ("eval:\n  metrics: [mrr@10, 5]\n", r"config\.eval\.metrics\[1\]: expected a string"),
        # of the literal's own type: 2.0 == 2 and True == 1 in Python (a float crashed the ColBERT index late)
        ("model:\n  colbert:\n    residual_bits: 2.0\n", r"config\.model\.colbert\.residual_bits: 2\.0 is not one of"),
        ("model:\n  colbert:\n    residual_bits: true\n", r"residual_bits: True is not one of 1, 2, 4, 8"),
        ("train: 3\n", r"config\.train: expected a mapping"),
        ("- a\n- b\n", r"top level must be a mapping"),
        ("train: [unclosed\n", r"not valid YAML"),
    ],
)
def test_wrong_types_name_the_field_path(tmp_path, text, message):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_invalid_json_is_a_config_error(tmp_path):
    path = tmp_path / "exp.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)


def test_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  batch_size: 3\n")
    config = load_config(path, ["train.batch_size=8", "eval.metrics=[ndcg@10]", "data.max_eval_queries=null", "name=x"])
    assert config.train.batch_size == 8
    assert config.eval.metrics == ["ndcg@10"]
    assert config.data.max_eval_queries is None
    assert config.name == "x"
    # overrides on defaults, creating the section
    assert load_config(None, ["model.projection_dim=12"]).model.projection_dim == 12


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.batch_szie=8", r"did you mean 'batch_size'"),
        ("train.batch_size=eight", r"config\.train\.batch_size: expected an integer"),
        ("train.batch_size", r"must look like section\.key=value"),
        ("name.sub=1", r"config\.name: expected a string"),
        # YAML reads an unquoted `query: ` as a mapping: the error says what to type instead
        ("model.query_prompt=query: ", r"""for the text "query: ", quote it.*--set 'model.query_prompt="query: "'"""),
        ("model.query_prompt=Instruct: a\\nQuery: ", r"""not valid YAML .*quote text holding ': ' or '#' \(--set"""),
        # and drops an unquoted '#' (first, or after a space) and what follows as a comment: an error, not a shorter
        # value (or a default, where nothing is left)
        ("model.query_prompt=find #1", r"what follows '#' as a comment"),
        ("eval.metrics=[mrr@10] # ndcg", r"what follows '#' as a comment"),
        ("data.data_dir=#cache", r"what follows '#' as a comment"),
        ('name="a #b" #c', r"what follows '#' as a comment"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("text", ["query: ", 'say "hi": ', "a\\b: x", "passage: ünïcode"])
def test_the_quoting_hint_is_an_override_that_loads_the_text_meant(text):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.query_prompt={text}"])
    [hint] = re.findall(r"--set '([^']*)' in an override", str(err.value))
    assert load_config(None, [hint]).model.query_prompt == text


def test_quoted_override_strings_keep_colons_hashes_and_escapes():
    config = load_config(
        None, ['model.query_prompt="Instruct: find it\\nQuery: "', "model.passage_prompt='passage #1: '", "name=a#b"]
    )
    assert config.model.query_prompt == "Instruct: find it\nQuery: "  # YAML's double quotes read \n as a newline
    assert config.model.passage_prompt == "passage #1: "
    assert config.name == "a#b"  # a '#' not after a space is no comment


def test_override_below_a_plain_value_is_rejected():
    with pytest.raises(ConfigError, match=r"'name' is not a section"):
        load_config(None, ["name=x", "name.sub=1"])


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    config = load_config(
        None,
        [
            "name=round",
            "train.batch_size=5",
            "eval.index=faiss-ivfpq",
            "model.projection_dim=8",
            "data.eval_subcorpus=true",
            "eval.metrics=[mrr@10, recall@3]",
        ],
    )
    path = tmp_path / "sub" / f"saved{suffix}"
    save_config(config, path)
    assert load_config(path) == config
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # written atomically, no temporary file
    if suffix == ".json":
        assert json.loads(path.read_text())["train"]["batch_size"] == 5


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


# ---- CLI errors -------------------------------------------------------------------------------


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("densepass: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_cli_missing_config_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in one_line_error(capsys)


def test_cli_config_typo(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  batch_szie: 3\n")
    assert main(["run", str(path)]) == 2
    line = one_line_error(capsys)
    assert "batch_szie" in line and "'batch_size'" in line


def test_cli_override_typo(capsys):
    assert main(["run", "--set", "eval.indx=exact"]) == 2
    assert "did you mean 'index'" in one_line_error(capsys)


def test_cli_unknown_dataset(tmp_path, capsys):
    assert main(["evaluate", "nosuch", str(tmp_path / "run.trec"), "--data-dir", str(tmp_path)]) == 2
    line = one_line_error(capsys)
    assert "dataset 'nosuch' not found" in line and str(tmp_path) in line


def test_cli_missing_run_file(tiny_beir, tmp_path, capsys):
    assert main(["evaluate", str(tiny_beir), str(tmp_path / "missing.trec")]) == 2
    assert "run file not found" in one_line_error(capsys)


def test_cli_bad_run_file_line(tiny_beir, tmp_path, capsys):
    run = tmp_path / "run.trec"
    run.write_text("q30 Q0 p30 1 0.9 t\nq31 Q0 p31\n")
    assert main(["evaluate", str(tiny_beir), str(run)]) == 2
    assert "run.trec:2: expected 6 columns" in one_line_error(capsys)


def test_cli_evaluate_prints_metrics(tiny_beir, tmp_path, capsys):
    run = tmp_path / "run.trec"
    # dev queries are q30..q39 with positives p30..p39; only q30 is answered, at rank 2
    run.write_text("q30 Q0 p0 1 0.9 t\nq30 Q0 p30 2 0.8 t\n")
    assert main(["evaluate", str(tiny_beir), str(run), "--metrics", "mrr@10", "recall@1"]) == 0
    printed = capsys.readouterr()  # evaluated on q30 alone, as trec_eval, with a one-line warning
    assert json.loads(printed.out) == pytest.approx({"mrr@10": 1 / 2, "recall@1": 0})
    assert "warning: the run answers 1 of the 10 queries" in printed.err
    assert main(["evaluate", str(tiny_beir), str(run), "--metrics", "mrr@10", "recall@1", "--all-queries"]) == 0
    out = json.loads(capsys.readouterr().out)  # as trec_eval -c: the nine missing queries score zero
    assert out == pytest.approx({"mrr@10": (1 / 2) / 10, "recall@1": 0 / 10})


def test_cli_evaluate_compare_to_reports_paired_test(tiny_beir, tmp_path, capsys):
    better, worse = tmp_path / "better.trec", tmp_path / "worse.trec"
    # every dev query q30..q39 answered at rank 1 by one run and at rank 2 by the other
    better.write_text("".join(f"q{q} Q0 p{q} 1 0.9 t\n" for q in range(30, 40)))
    worse.write_text("".join(f"q{q} Q0 p0 1 0.9 t\nq{q} Q0 p{q} 2 0.8 t\n" for q in range(30, 40)))
    assert main(["evaluate", str(tiny_beir), str(better), "--compare-to", str(worse), "--metrics", "mrr@10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"] == {"mrr@10": 1.0} and out["baseline"] == {"mrr@10": 0.5}
    test = out["paired_fisher"]["mrr@10"]
    assert (test["delta"], test["wins"], test["ties"], test["losses"]) == (0.5, 10, 0, 0)
    assert test["p"] == pytest.approx(2 / 2**10, abs=0.005)  # only the all-kept and all-swapped assignments


# ---- evaluation subcorpus ---------------------------------------------------------------------


@pytest.fixture
def dataset_and_bm25(tiny_beir):
    from densepass.data import load_dataset
    from densepass.index.bm25 import BM25Index

    dataset = load_dataset(str(tiny_beir))
    return dataset, BM25Index.build(dataset.corpus.passage_inputs(" "))


def subcorpus_config(**changes) -> DataConfig:
    base = DataConfig(eval_split="dev", max_eval_queries=4, eval_subcorpus=True, eval_hard_k=3, eval_random=5, seed=7)
    return dataclasses.replace(base, **changes)


def test_eval_subcorpus_has_gold_bm25_and_random_passages(dataset_and_bm25):
    from densepass.pipelines.evalset import build_eval_set

    dataset, bm25 = dataset_and_bm25
    dev = dataset.split("dev")
    config = subcorpus_config()
    eval_set = build_eval_set(dataset, config, bm25)

    assert len(eval_set.query_ids) == 4 and eval_set.query_ids == sorted(eval_set.query_ids)
    assert set(eval_set.query_ids) <= set(dev)
    assert eval_set.query_texts == [dataset.queries[q] for q in eval_set.query_ids]
    assert eval_set.qrels == {q: dev[q] for q in eval_set.query_ids}

    ids = eval_set.corpus.ids
    assert len(set(ids)) == len(ids)
    gold = {p for q in eval_set.query_ids for p, g in dev[q].items() if g > 0}
    _, rows = bm25.search_rows(eval_set.query_texts, 3)
    hard = {dataset.corpus.ids[r] for r in rows.ravel().tolist()}
    assert hard - gold, "BM25 should add passages beyond the gold ones on this data"
    assert gold <= set(ids)
    assert hard <= set(ids)
    extra = set(ids) - gold - hard
    assert len(extra) == config.eval_random
    assert len(ids) == len(gold | hard) + config.eval_random

    # the subcorpus keeps corpus order and each passage's own title and text
    positions = [dataset.corpus.position(p) for p in ids]
    assert positions == sorted(positions)
    assert eval_set.corpus.texts == [dataset.corpus.texts[i] for i in positions]
    assert eval_set.corpus.titles == [dataset.corpus.titles[i] for i in positions]
    assert "4 dev queries" in eval_set.description


def test_eval_subcorpus_is_deterministic_under_seed(dataset_and_bm25):
    from densepass.pipelines.evalset import build_eval_set

    dataset, bm25 = dataset_and_bm25
    first = build_eval_set(dataset, subcorpus_config(), bm25)
    second = build_eval_set(dataset, subcorpus_config(), bm25)
    assert first.query_ids == second.query_ids
    assert first.corpus.ids == second.corpus.ids
    others = [build_eval_set(dataset, subcorpus_config(seed=s), bm25) for s in (1, 2, 3)]
    assert any((o.query_ids, o.corpus.ids) != (first.query_ids, first.corpus.ids) for o in others)


def test_eval_subcorpus_random_only_and_capped(dataset_and_bm25):
    from densepass.pipelines.evalset import build_eval_set

    dataset, _ = dataset_and_bm25
    eval_set = build_eval_set(dataset, subcorpus_config(eval_hard_k=0, eval_random=2, max_eval_queries=None), None)
    assert len(eval_set.query_ids) == 10  # every dev query
    assert len(eval_set.corpus) == 10 + 2  # their 10 distinct positives + 2 random
    everything = build_eval_set(dataset, subcorpus_config(eval_hard_k=0, eval_random=10_000), None)
    assert len(everything.corpus) == len(dataset.corpus)


def test_eval_set_full_corpus_and_errors(dataset_and_bm25):
    from densepass.pipelines.evalset import build_eval_set

    dataset, _ = dataset_and_bm25
    full = build_eval_set(dataset, subcorpus_config(eval_subcorpus=False), None)
    assert full.corpus is dataset.corpus and len(full.query_ids) == 4
    with pytest.raises(ConfigError, match="needs a BM25 index"):
        build_eval_set(dataset, subcorpus_config(), None)
    with pytest.raises(ConfigError, match=">= 0"):
        build_eval_set(dataset, subcorpus_config(eval_random=-1), None)


def test_experiment_scripts_report_errors_in_one_line():
    """experiments/*.py wrap their main in run_guarded: a config typo is one line and exit code 2."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "experiments" / "abs_table2.py"
    done = subprocess.run([sys.executable, str(script), "--set", "train.batch_szie=3"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "abs_table2.py: error: config.train: unknown key 'batch_szie' (did you mean 'batch_size'?)"
    )
    done = subprocess.run([sys.executable, str(script), "--only", "ABS-BM26"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().startswith(
        "abs_table2.py: error: --only: unknown variant(s) ABS-BM26 (known: Non-ABS-Sequential"
    )


# ---- ranges, duplicate keys and the help of every key ---------------------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.batch_size=0", "train.batch_size: must be >= 1, got 0"),
        ("train.epochs=0", "train.epochs: must be >= 1, got 0"),
        ("train.learning_rate=-1e-5", "train.learning_rate: must be > 0"),
        ("train.warmup_ratio=1.5", "train.warmup_ratio: must be <= 1"),
        ("train.checkpoint_every=0", "train.checkpoint_every: must be >= 1"),
        ("eval.batch_size=0", "eval.batch_size: must be >= 1"),
        ("eval.depth=0", "eval.depth: must be >= 1"),
        ("negatives.per_query=-1", "negatives.per_query: must be >= 0"),
        ("negatives.pool_depth=0", "negatives.pool_depth: must be >= 1"),
        ("model.temperature=0", "model.temperature: must be > 0"),
        ("data.max_train_queries=0", "data.max_train_queries: must be >= 1"),
        ("validation.r=0", "validation.r: must be > 0"),
        ("train.learning_rate=.nan", "expected a finite number"),
        ("eval.baselines=[bm26]", "eval.baselines[0]: 'bm26' is not one of"),
    ],
)
def test_sizes_counts_and_rates_out_of_range_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_pretraining_ranges_are_checked_too():
    from densepass.pretraining.config import PretrainConfig

    with pytest.raises(ConfigError, match="train.batch_size: must be >= 1"):
        load_config(None, ["train.batch_size=0"], PretrainConfig)


def test_a_key_written_twice_is_an_error_with_its_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch_size: 8\n  epochs: 2\n  batch_size: 16\n")
    with pytest.raises(ConfigError, match=r"c.yaml:4: key 'batch_size' appears twice \(first on line 2\)"):
        load_config(path)
    path = tmp_path / "c.json"
    path.write_text('{"name": "a", "name": "b"}')
    with pytest.raises(ConfigError, match="'name' appears twice"):
        load_config(path)


def test_a_config_that_is_not_utf8_is_a_one_line_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


def test_every_key_has_help_and_the_explanation_lists_them_all():
    from densepass.config import ExperimentConfig, explain
    from densepass.pretraining.config import PretrainConfig

    for cls in (ExperimentConfig, PretrainConfig):
        rows = explain(cls)
        assert all(help_text for _, _, _, help_text in rows), [k for k, _, _, h in rows if not h]
        keys = {key for key, _, _, _ in rows}
        assert len(keys) == len(rows)
    keys = {key: kind for key, kind, _, _ in explain(ExperimentConfig)}
    assert keys["train.batch_size"] == "int, >= 1" and "model.name_or_path" in keys and "model.pooling" in keys


def test_model_config_is_the_architecture_plus_the_starting_weights():
    from densepass.config import BiEncoderConfig, ModelConfig

    model = ModelConfig(name_or_path="m", projection_dim=25, pooling="cls")
    assert model.architecture() == BiEncoderConfig(projection_dim=25, pooling="cls")


def test_cli_config_explains_every_key_and_prints_the_resolved_config(capsys):
    from densepass.cli import main

    assert main(["config", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "train.batch_size  (int, >= 1; default 64)" in text and "negatives.refresh_every" in text
    assert main(["config", "--set", "train.batch_size=8"]) == 0
    assert "batch_size: 8" in capsys.readouterr().out
    assert main(["config", "--set", "train.batch_size=0"]) == 2
    assert "train.batch_size: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parent.parent / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_config_loads(path):
    """A typo in a shipped config fails here, not after its command's first minutes."""
    from densepass.phrase.config import PhraseConfig
    from densepass.pretraining.config import PretrainConfig

    cls = (
        PretrainConfig
        if path.name.startswith("pretrain_")
        else PhraseConfig
        if path.name.startswith("phrase_")
        else None
    )
    config = load_config(path, [], cls) if cls else load_config(path, [])
    assert config.name


@pytest.mark.parametrize(
    "override, read_as",
    [
        ("train.batch_size=010", "8"),  # YAML 1.1 octal
        ("eval.depth=1:40", "100"),  # base 60
        ("train.learning_rate=0x10", "16"),
        ("train.batch_size=0b11", "3"),
        ("train.learning_rate=1:30.5", "90.5"),
        ("name=010", "8"),
    ],
)
def test_numbers_yaml_1_1_reads_otherwise_are_refused_naming_the_key(tmp_path, override, read_as):
    """`--set train.batch_size=010` trained with batches of 8, `eval.depth=1:40` retrieved 100 passages."""
    key, value = override.split("=")
    message = rf"^config\.{re.escape(key)}: YAML reads {re.escape(value)} as {re.escape(read_as)} "
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    section, _, leaf = key.rpartition(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {leaf}: {value}\n" if section else f"{leaf}: {value}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    assert load_config(None, ["train.batch_size=8", "eval.depth=100", "name='010'"]).name == "010"


@pytest.mark.parametrize("text", ["1_0", "inf", " 1", "0x10", "١"])
def test_a_text_becomes_a_float_only_as_plain_decimal_text(text):
    """Python's float() read '1_0' as 10.0 (and 'inf', ' 1', Arabic-Indic digits): only 5e-5-like text is taken."""
    with pytest.raises(ConfigError, match=r"^config\.train\.learning_rate: expected a number, got "):
        load_config(None, [f"train.learning_rate='{text}'"])
    assert load_config(None, ["train.learning_rate='5e-5'"]).train.learning_rate == 5e-5
    assert load_config(None, ["negatives.cross_encoder_threshold='-.5E+2'"]).negatives.cross_encoder_threshold == -50


def test_a_section_whose_keys_are_all_commented_out_takes_its_defaults(tmp_path):
    """`train:` followed only by comments is null in YAML: it was refused ("expected a mapping, got NoneType")."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  # batch_size: 8\nmodel:\n  pooling: cls\n")
    assert load_config(path).train.batch_size == 64
    assert load_config(path, ["train.batch_size=8"]).train.batch_size == 8  # an override into the null section
    path.write_text("data:\n  mix:\n    -\n")  # an entry of a list, though, is no section left out
    with pytest.raises(ConfigError, match=r"config\.data\.mix\[0\]: expected a mapping, got NoneType"):
        load_config(path)


def test_explain_shows_exclusive_bounds_and_the_keys_of_list_entries():
    """`data.eval_part_fraction` was shown "<= 1" though 1 is refused, and `data.mix` without its entries' keys."""
    from densepass.config import explain

    rows = {key: kind for key, kind, _, _ in explain(ExperimentConfig)}
    assert rows["data.eval_part_fraction"] == "float, > 0, < 1"
    assert rows["data.mix[].fraction"] == "float, <= 0.9, > 0" and rows["data.mix[].format"] == "beir|msmarco|dpr|squad"
    assert {"data.mix[].name", "data.mix[].split"} <= set(rows)
    with pytest.raises(ConfigError, match=r"data\.eval_part_fraction: must be < 1, got 1"):
        load_config(None, ["data.eval_part=tune", "data.eval_part_fraction=1"])


def test_config_prints_the_saved_architecture_the_run_uses(tmp_path, tiny_model_dir, capsys):
    """`densepass config` printed the defaults (mean pooling, no projection) where `densepass run` takes the saved
    model's (``with_saved_architecture``): running the printed YAML failed or pooled otherwise."""
    import yaml

    from densepass.config import BiEncoderConfig
    from densepass.models.biencoder import BiEncoder
    from densepass.pipelines.retrievers import with_saved_architecture

    saved = BiEncoderConfig(pooling="cls", projection_dim=8, passage_max_length=64)
    BiEncoder.from_pretrained(str(tiny_model_dir), config=saved).save(tmp_path / "m")
    overrides = [f"model.name_or_path={tmp_path / 'm'}"]
    assert main(["config", "--set", overrides[0]]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["pooling"], model["projection_dim"], model["passage_max_length"]) == ("cls", 8, 64)
    assert main(["config", "--set", overrides[0], "--output", str(tmp_path / "x.yaml")]) == 0
    printed = load_config(tmp_path / "x.yaml")
    assert printed == with_saved_architecture(load_config(None, overrides))  # what run runs
    assert with_saved_architecture(printed).model.architecture() == saved


def test_a_mapping_given_for_a_section_sets_its_keys_and_keeps_the_others(tmp_path):
    """`--set 'train={epochs: 2}'` replaced the whole section: the file's batch size and learning rate went back to
    their defaults, in silence. `section=null` is how a section is put back to its defaults."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch_size: 16\n  learning_rate: 1.0e-4\nnegatives:\n  source: bm25\n  pool_depth: 9\n")
    config = load_config(str(path), ["train={epochs: 3}", "negatives={pool_depth: 7}"])
    assert (config.train.epochs, config.train.batch_size, config.train.learning_rate) == (3, 16, 1e-4)
    assert (config.negatives.source, config.negatives.pool_depth) == ("bm25", 7)
    reset = load_config(str(path), ["train=null", "train={epochs: 3}"])
    default = load_config(None, [])
    assert (reset.train.epochs, reset.train.batch_size) == (3, default.train.batch_size)
    with pytest.raises(ConfigError, match="bogus"):
        load_config(str(path), ["train={bogus: 1}"])
